"""Checkpoint calls, timed for the job's telemetry (`telemetry.py`).

`torch.distributed.checkpoint`'s `save`, `async_save` and `load` are wrapped when the
package is imported (at once if it already is; `imports.py`), and so are the frameworks'
own checkpoint calls (`frameworks.py`: the Hugging Face Trainer, Accelerate, Lightning). A
save is timed on the loop (the call) and, when it goes on in the background, there too;
its record goes out once the checkpoint is durable, and not at all when it failed. A
wrapper costs nothing while telemetry is off (it calls through), and a wrapped call inside
another (a framework saving through DCP) is not counted twice. Only the modules' attributes
are wrapped: a name bound before (`from torch.distributed.checkpoint import save` ahead of
an explicit `enable()`) keeps calling the unwrapped function.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal, Protocol

from megacache_client.torch import imports

log = logging.getLogger("megacache")

DCP = "torch.distributed.checkpoint"
Kind = Literal["save", "async_save", "load", "load_part", "load_last", "load_end"]
"""A restore may be several calls: each `load_part` is added up, and the sum is sent as one
restore at `load_last` (timed too) or `load_end` (not timed), else at the next step."""
StepOf = Callable[[tuple[Any, ...]], int | None]
"""The step a call saves or resumes from, read off its arguments (a framework's trainer
knows it: `args[0]` is the trainer for a method); None: the telemetry's own count."""
_inside = threading.local()
"""Set while a wrapped checkpoint call runs: a wrapped call inside another is not counted."""


class Recorder(Protocol):
    """Who is told of checkpoints: the process's `telemetry.Telemetry`, which this module
    never imports (`watch_checkpoints` is handed it), so the arrow runs one way only."""

    @property
    def step(self) -> int: ...

    def saved(self, at: float, blocking_s: float, background_s: float | None,
              step: int | None) -> None: ...

    def restoring(self, at: float, blocking_s: float, step: int | None) -> None: ...

    def restored(self, step: int | None) -> None: ...

    def loaded(self, at: float, blocking_s: float, step: int | None) -> None: ...


def _nobody() -> Recorder | None:
    return None


_active: Callable[[], Recorder | None] = _nobody
"""The running telemetry (`telemetry.active`, set by `watch_checkpoints`)."""


def timed(kind: Kind, fn: Callable[..., Any], step_of: StepOf | None = None,
          background: Callable[[Any, tuple[Any, ...]], Any] | None = None,
          when: Callable[[tuple[Any, ...]], bool] | None = None) -> Callable[..., Any]:
    """`fn` timed as a checkpoint `kind`. `background(result, args)` gives the future a save
    goes on in (None: the call was all of it); by default an `async_save`'s result (or its
    `upload_completion`). `when(args)`, asked after the call: whether it checkpointed at all
    (a restore call given no checkpoint did not)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = _active()
        if t is None or getattr(_inside, "busy", False):
            return fn(*args, **kwargs)
        at, began = time.time(), time.monotonic()
        _inside.busy = True
        try:
            result = fn(*args, **kwargs)
        finally:
            _inside.busy = False
        blocking = time.monotonic() - began
        try:
            if when is not None and not when(args):
                return result
            step = step_of(args) if step_of is not None else None
            if kind in ("load_part", "load_last"):
                t.restoring(at, blocking, step)
            if kind in ("load_last", "load_end"):
                t.restored(step)
            if kind.startswith("load"):
                if kind == "load":
                    t.loaded(at, blocking, step)
                return result
            step = t.step if step is None else step
            future = background(result, args) if background is not None else (
                getattr(result, "upload_completion", result) if kind == "async_save" else None)
            if future is None:
                t.saved(at, blocking, None, step)
            else:
                _when_written(future, t, at, blocking, step)
        except Exception as exc:  # the checkpoint is the trainer's; the record only ours
            log.debug("megacache: checkpoint not recorded: %s", exc)
        return result

    wrapper._megacache_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def _when_written(future: Any, t: Recorder, at: float, blocking: float, step: int) -> None:
    """A save went on in the background: its record goes out when it is done, if it worked."""
    returned = time.monotonic()

    def done(f: Any) -> None:
        try:
            if not f.cancelled() and f.exception() is None:
                t.saved(at, blocking, time.monotonic() - returned, step)
        except Exception as exc:
            log.debug("megacache: background checkpoint not recorded: %s", exc)

    try:
        future.add_done_callback(done)
    except Exception:  # not a future: count what the loop waited
        t.saved(at, blocking, None, step)


def wrap(owner: Any, name: str, kind: Kind, step_of: StepOf | None = None,
         background: Callable[[Any, tuple[Any, ...]], Any] | None = None,
         when: Callable[[tuple[Any, ...]], bool] | None = None) -> bool:
    """Wrap `owner.name` (a module's function or a class's method) once; False if absent."""
    fn = getattr(owner, name, None)
    if not callable(fn):
        return False
    if not getattr(fn, "_megacache_wrapped", False):
        setattr(owner, name, timed(kind, fn, step_of, background, when))
    return True


def patch_dcp(module: ModuleType) -> None:
    """Wrap torch.distributed.checkpoint's save, async_save and load (once)."""
    for name in ("save", "async_save", "load"):
        wrap(module, name, name)  # type: ignore[arg-type]


def watch_checkpoints(active: Callable[[], Recorder | None]) -> None:
    """Time DCP's checkpoint calls from now on (patched when the trainer imports it), and
    the frameworks' once `frameworks.watch()` has run too (`telemetry.install` runs both:
    this module is below `frameworks.py`, which wraps with it); `active` says whether
    telemetry runs (and which)."""
    global _active
    _active = active
    imports.when_imported(DCP, patch_dcp)
