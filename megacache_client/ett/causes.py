"""Why an attempt ended, as the process itself can tell (`wire.progress.CAUSES`).

Rank 0's telemetry asks here when its attempt ends (`telemetry.py`):

- an uncaught exception (`sys.excepthook`): `oom` for torch's `OutOfMemoryError` (CUDA,
  XPU, MPS: one class), `MemoryError` and an allocator's "out of memory" message;
  `collective_timeout` for a collective or a process group's store that timed out (torch's
  `DistBackendError`/`DistStoreError`/`DistNetworkError` or gloo's and NCCL's messages:
  "Timed out", "Watchdog caught collective operation timeout"); else `exception`. The
  exception's cause and context are looked through (a framework's wrapper of an OOM is
  an OOM); `detail` is the exception's type (module and name);
- `sys.exit(n)`: atexit cannot see the code, so `sys.exit` (and the `exit`/`quit`
  builtins) are wrapped to note it on the main thread: n != 0 is `exit_code` (a string
  or any other object: 1, as Python exits with), 0 or None is finished. A `SystemExit`
  caught by the trainer, which then trains on, is forgotten at its next optimizer step.
  Called while an exception is being handled (`except Exception: sys.exit(1)`), the
  exception names the cause (`oom`, ...), the code the detail. `raise SystemExit(n)` and
  a `sys.exit` bound before the client was enabled go unseen: finished;
- SIGTERM (`steps/preemption.py`'s handler): `preempted`, whatever ends the process after.

Everything here is fail-open: a question it cannot answer is `unknown`, never a guess.
"""

from __future__ import annotations

import builtins
import sys
import threading
from collections.abc import Callable
from typing import Any

from megacache_client.wire.progress import DETAIL_CAP, Cause

OOM_TYPES = ("OutOfMemoryError", "MemoryError")
"""torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class) and Python's."""
OOM_WORDS = ("out of memory", "can't allocate memory", "not enough memory",
             "failed to allocate memory")
"""An allocator's words for it (CUDA, HIP, MPS, XPU, torch's CPU allocator)."""
DIST_TYPES = ("DistBackendError", "DistStoreError", "DistNetworkError", "DistError")
TIMEOUT_WORDS = ("timed out", "timeout", "watchdog caught collective operation")
COLLECTIVE_WORDS = ("gloo", "nccl", "collective", "process group", "processgroup",
                    "c10d", "store", "barrier", "allreduce", "all_reduce", "rendezvous")
CHAIN_DEPTH = 8


def of_exception(exc: BaseException) -> tuple[Cause, str]:
    """The cause an uncaught exception names, and its type as the detail."""
    seen: set[int] = set()
    found: Cause = "exception"
    link: BaseException | None = exc
    for _ in range(CHAIN_DEPTH):
        if link is None or id(link) in seen:
            break
        seen.add(id(link))
        cause = _one(link)
        if cause == "oom":
            return "oom", _type_name(link)
        if cause == "collective_timeout":
            found = cause
            exc = link
        link = link.__cause__ or link.__context__
    return found, _type_name(exc)


def _one(exc: BaseException) -> Cause:
    names = {k.__name__ for k in type(exc).__mro__}
    try:
        text = str(exc)[:2000].lower()
    except Exception:  # a broken __str__: the type alone says what it can
        text = ""
    if names & set(OOM_TYPES) or any(w in text for w in OOM_WORDS):
        return "oom"
    timeout = isinstance(exc, TimeoutError) or any(w in text for w in TIMEOUT_WORDS)
    if timeout and (names & set(DIST_TYPES) or any(w in text for w in COLLECTIVE_WORDS)):
        return "collective_timeout"
    return "exception"


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    module = getattr(kind, "__module__", "") or ""
    name = getattr(kind, "__qualname__", kind.__name__)
    full = name if module in ("builtins", "") else f"{module}.{name}"
    return full[:DETAIL_CAP]


def exit_code_of(code: Any) -> int:
    """The process's exit code for `sys.exit(code)`, as Python computes it."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return max(-(2**31), min(code, 2**31 - 1))
    return 1  # a message: printed, and the process exits with 1


class ExitWatch:
    """`sys.exit` and the `exit`/`quit` builtins, wrapped to note the code (see the
    module). Installed once per process; `noted` is what the main thread asked for last."""

    def __init__(self) -> None:
        self.noted: tuple[int, BaseException | None] | None = None
        """(exit code, the exception being handled when sys.exit was called)."""
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        if self._originals:
            return
        self._wrap(sys, "exit")
        for name in ("exit", "quit"):
            if callable(getattr(builtins, name, None)):
                self._wrap(builtins, name)

    def uninstall(self) -> None:
        for key, original in self._originals.items():
            where, name = key.split(":", 1)
            setattr(sys if where == "sys" else builtins, name, original)
        self._originals.clear()

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        if getattr(original, "_megacache_exit", False):
            return
        watch = self

        def noting_exit(*args: Any, **kwargs: Any) -> Any:
            try:
                if threading.current_thread() is threading.main_thread():
                    code = args[0] if args else kwargs.get("status", kwargs.get("code"))
                    handling = sys.exc_info()[1]
                    watch.noted = (exit_code_of(code), handling)
            except Exception:  # noting must never stop the exit
                pass
            return original(*args, **kwargs)

        noting_exit._megacache_exit = True  # type: ignore[attr-defined]
        noting_exit.__doc__ = getattr(original, "__doc__", None)
        self._originals[f"{'sys' if owner is sys else 'builtins'}:{name}"] = original
        setattr(owner, name, noting_exit)

    def forget(self) -> None:
        """The trainer went on after a SystemExit it caught: it is not how it ends."""
        self.noted = None

    def ending(self) -> tuple[Cause | None, str | None, int | None]:
        """At interpreter exit: (cause, detail, exit code) of a `sys.exit(n)`, n != 0
        (with the exception it was handling as the cause); (None, None, 0) otherwise."""
        if self.noted is None or self.noted[0] == 0:
            return None, None, 0
        code, handling = self.noted
        if handling is not None and not isinstance(handling, SystemExit):
            cause, kind = of_exception(handling)
            return cause, f"{kind}, then exit code {code}"[:DETAIL_CAP], code
        return "exit_code", f"exit code {code}", code
