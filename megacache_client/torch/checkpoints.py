"""torch.distributed.checkpoint, timed for the job's telemetry (`telemetry.py`).

`save`, `async_save` and `load` of the package are wrapped when it is imported (at once if
it already is): a save is timed on the loop (the call) and, for `async_save`, in the
background too (until the returned future, or the response's `upload_completion`, is done);
its record goes out once the checkpoint is durable, and not at all when it failed. A
wrapper costs nothing while telemetry is off (it calls through). Only the package's
attributes are wrapped: a name bound before (`from torch.distributed.checkpoint import
save` ahead of an explicit `enable()`) keeps calling the unwrapped function.

This module knows nothing of telemetry: `watch_checkpoint_module` is handed the function
that names the process's recorder (`telemetry.active`), so the arrow runs one way only.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

log = logging.getLogger("megacache")

DCP = "torch.distributed.checkpoint"
_inside = threading.local()
"""Set while a wrapped checkpoint call runs: a wrapped call inside another is not counted."""


class Recorder(Protocol):
    """Who is told of checkpoints (the process's `telemetry.Telemetry`)."""

    @property
    def step(self) -> int: ...

    def saved(self, at: float, blocking_s: float, background_s: float | None,
              step: int | None) -> None: ...

    def loaded(self, at: float, blocking_s: float, step: int | None) -> None: ...


def _nobody() -> Recorder | None:
    return None


_recorder: Callable[[], Recorder | None] = _nobody
"""The recorder of the moment, or None (telemetry off): the wrappers then call through."""


def _timed(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = _recorder()
        if t is None or getattr(_inside, "busy", False):
            return fn(*args, **kwargs)
        at, began, step = time.time(), time.monotonic(), t.step
        _inside.busy = True
        try:
            result = fn(*args, **kwargs)
        finally:
            _inside.busy = False
        blocking = time.monotonic() - began
        try:
            if kind == "load":
                t.loaded(at, blocking, None)
            elif kind == "save":
                t.saved(at, blocking, None, step)
            else:
                _when_written(result, t, at, blocking, step)
        except Exception as exc:  # the checkpoint is the trainer's; the record only ours
            log.debug("megacache: checkpoint not recorded: %s", exc)
        return result

    wrapper._megacache_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def _when_written(result: Any, t: Recorder, at: float, blocking: float, step: int) -> None:
    """An async save returned: its record goes out when its upload is done, if it worked."""
    returned = time.monotonic()
    future = getattr(result, "upload_completion", result)

    def done(f: Any) -> None:
        try:
            if not f.cancelled() and f.exception() is None:
                t.saved(at, blocking, time.monotonic() - returned, step)
        except Exception as exc:
            log.debug("megacache: async checkpoint not recorded: %s", exc)

    try:
        future.add_done_callback(done)
    except Exception:  # not a future: count what the loop waited
        t.saved(at, blocking, None, step)


def patch_checkpoint_module(module: ModuleType) -> None:
    """Wrap the package's save, async_save and load (once)."""
    for name in ("save", "async_save", "load"):
        fn = getattr(module, name, None)
        if callable(fn) and not getattr(fn, "_megacache_wrapped", False):
            setattr(module, name, _timed(name, fn))


def watch_checkpoint_module(recorder: Callable[[], Recorder | None]) -> None:
    """Patch torch.distributed.checkpoint now if imported, else right after its import; its
    calls are told to whoever `recorder()` names when they run."""
    global _recorder
    _recorder = recorder
    module = sys.modules.get(DCP)
    if module is not None and hasattr(module, "save"):
        patch_checkpoint_module(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport:
    """A meta-path finder that finds nothing itself: it wraps the loader of
    torch.distributed.checkpoint to patch the package once it has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != DCP:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):  # whoever would have found it without us
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            try:
                patch_checkpoint_module(module)
            except Exception as exc:
                log.debug("megacache: checkpoint calls not timed: %s", exc)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
