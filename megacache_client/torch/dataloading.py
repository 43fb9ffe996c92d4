"""The time the training loop waits for its next batch (ETT's `data_wait`).

In a real job the largest share of what nobody reports is the loop waiting on its data
(Google's goodput calls it DATA_LOADING_SYNC). Every loop people write or run, the
frameworks' included (the Hugging Face Trainer, Accelerate's `DataLoaderShard`, Lightning's
fetchers), asks torch's `DataLoader` iterator for the next batch; its `__next__` is timed,
on rank 0 with telemetry on, on the thread that runs the optimizer steps, from the first
step on (the first batch is part of the start). The cost per batch is two clock reads and
an addition (`benchmarks/dataloader_bench.py` measures it beside a 10 ms step); with
telemetry off the wrapper only asks whether it is on.
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


def timed_next(next_batch: Callable[[Any], Any]) -> Callable[[Any], Any]:
    get_ident, clock = threading.get_ident, time.perf_counter

    @functools.wraps(next_batch)
    def __next__(self: Any) -> Any:
        t = _active()
        if t is None or t.loop_thread != get_ident():
            return next_batch(self)
        began = clock()
        try:
            return next_batch(self)
        finally:
            t.data_wait_s += clock() - began

    __next__._megacache_wrapped = True  # type: ignore[attr-defined]
    return __next__
