"""The time the training loop waits for its next batch (ETT's `data_wait`).

In a real job the largest share of what nobody reports is the loop waiting on its data
(Google's goodput calls it DATA_LOADING_SYNC). Every loop people write or run, the
frameworks' included (the Hugging Face Trainer, Accelerate's `DataLoaderShard`, Lightning's
fetchers), asks torch's `DataLoader` iterator for the next batch; its `__next__` is timed,
on rank 0 with telemetry on, on the thread that runs the optimizer steps, from the first
step on (the first batch is part of the start). The cost per batch is two clock reads and
an addition (`benchmarks/dataloader_bench.py` measures it beside a 10 ms step); with
telemetry off the wrapper only asks whether it is on.

Before the first step, the first iterator's wait for its first batch (from its
construction, where its workers start, to its first batch) is the start's `first_batch`
component (`phases.py`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


class Loop(Protocol):
    """What the timing needs of the process's telemetry (`telemetry.Telemetry`, which this
    module never imports: `watch` is handed it)."""

    loop_thread: int | None
    """The thread that runs the optimizer steps (None before the first)."""
    data_wait_s: float

    def first_batch(self, began: float) -> None:
        """The first iterator, made at `began`, gave its first batch (before the first
        step)."""


def _nobody() -> Loop | None:
    return None


_active: Callable[[], Loop | None] = _nobody


def watch(active: Callable[[], Loop | None]) -> None:
    """Time `DataLoader` iterators' `__next__` from now on (once per process)."""
    global _active
    _active = active
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    if not getattr(base.__next__, "_megacache_wrapped", False):
        base.__next__ = timed_next(base.__next__)  # type: ignore[method-assign,assignment]
        base.__init__ = noted_init(base.__init__)  # type: ignore[method-assign]


_first_iterator: list[int] = []
"""The id of the first iterator made (before the first step), while it has not given its
first batch."""
_began = [0.0]


def noted_init(init: Callable[..., None]) -> Callable[..., None]:
    """The iterator's construction: the first one's start is the first batch's wait."""
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        t = _active()
        first = t is not None and t.loop_thread is None and not _first_iterator
        began = time.time()
        init(self, *args, **kwargs)
        if first:
            _first_iterator.append(id(self))
            _began[0] = began

    return __init__


def timed_next(next_batch: Callable[[Any], Any]) -> Callable[[Any], Any]:
    get_ident, clock = threading.get_ident, time.perf_counter

    @functools.wraps(next_batch)
    def __next__(self: Any) -> Any:
        t = _active()
        if t is None:
            return next_batch(self)
        if t.loop_thread != get_ident():
            if _first_iterator and _first_iterator[0] == id(self) and t.loop_thread is None:
                batch = next_batch(self)
                _first_iterator[0] = -1  # seen: no other iterator is the first
                t.first_batch(_began[0])
                return batch
            return next_batch(self)
        began = clock()
        try:
            return next_batch(self)
        finally:
            t.data_wait_s += clock() - began

    __next__._megacache_wrapped = True  # type: ignore[attr-defined]
    return __next__
