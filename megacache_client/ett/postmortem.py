"""How an attempt that said nothing died, as far as the next one on the node can tell.

A process killed by a signal runs no Python: no end record, no cause. What the restart on
the same node can still read (`lifeline.Lifeline.orphans` asks here) is:

- the container's OOM kills: the cgroup's `oom_kill` counter (`memory.events` in cgroup
  v2, `memory.oom_control` in v1), noted with each lifeline renewal; higher now than at
  the attempt's last renewal: the kernel's OOM killer came (`killed`, said so in the
  detail: the counter is the container's, not the process's);
- a fatal signal's dump: Python's `faulthandler` writes, on SIGSEGV, SIGABRT, SIGBUS,
  SIGFPE or SIGILL, which signal and every thread's stack to the attempt's file on the
  node (enabled only when the trainer has not enabled `faulthandler` itself; forked
  children write nothing there). A SIGABRT while the main thread waited in
  `torch.distributed` is how the NCCL watchdog ends a process whose collective timed out:
  `collective_timeout`; any other fatal signal is `killed`, with its name;
- neither: `killed` (SIGKILL, or a signal without a dump): the process is gone and never
  said how.

Everything here is best effort: a file that cannot be read says nothing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
from pathlib import Path
from typing import IO

from megacache_client.wire.progress import DETAIL_CAP, Cause

log = logging.getLogger("megacache")

FATAL = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
         "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE",
         "Illegal instruction": "SIGILL"}
"""faulthandler's words for each fatal signal (its first line: `Fatal Python error: ...`)."""
DUMP_CAP = 64 * 1024
SILENT = "no end record: SIGKILL, the OOM killer or a crash without a dump"

_counter: Path | None | bool = False
"""The cgroup file with the OOM kill count (None: none found; False: not looked yet)."""


def oom_kills() -> int | None:
    """The OOM kills the kernel counted in this process's cgroup (None: not readable)."""
    global _counter
    if _counter is False:
        _counter = _find_counter()
    if _counter is None or _counter is True:
        return None
    try:
        text = _counter.read_text()
    except OSError:
        return None
    match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _find_counter(root: Path = Path("/sys/fs/cgroup"),
                  table: Path = Path("/proc/self/cgroup")) -> Path | None:
    try:
        lines = table.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if number == "0" and controllers == "":
            found = [root / rel / "memory.events", root / "unified" / rel / "memory.events"]
        elif "memory" in controllers.split(","):
            found = [root / "memory" / rel / "memory.oom_control"]
        else:
            continue
        for candidate in found:
            if candidate.is_file() and "oom_kill " in _read(candidate):
                return candidate
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()[:4096]
    except OSError:
        return ""


class FatalDump:
    """This attempt's fatal-signal dump on the node (faulthandler's file), when ours."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def enable(self) -> bool:
        """Dump fatal signals to `path`, unless the trainer has faulthandler on already."""
        if faulthandler.is_enabled():
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w")  # noqa: SIM115 (held for faulthandler)
            faulthandler.enable(file=self._file, all_threads=True)
        except (OSError, ValueError, RuntimeError) as exc:
            log.debug("megacache: no fatal-signal dump: %s", exc)
            return False
        _ours.append(self)
        return True

    def remove(self) -> None:
        """The attempt ended and said so: nothing for a later one to read. The file goes;
        faulthandler keeps its descriptor (a crash while the interpreter ends writes to the
        unlinked file): disabling it could silence a handler the trainer set since, and
        closing the file could hand its number to another file."""
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


_ours: list[FatalDump] = []


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) dumps nowhere of ours: its crash is its own."""
    for dump in _ours:
        if dump._file is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                faulthandler.disable()
            dump._file = None
    _ours.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def verdict(dump: Path | None, oom_then: int | None, oom_now: int | None
            ) -> tuple[Cause, str]:
    """How a silent attempt died: from its fatal-signal dump (if any) and the cgroup's OOM
    kill count at its last renewal and now (see the module)."""
    text = ""
    if dump is not None:
        try:
            text = dump.read_text(errors="replace")[:DUMP_CAP]
        except OSError:
            text = ""
    match = re.search(r"Fatal Python error: ([A-Za-z -]+)", text)
    if match is not None:
        name = FATAL.get(match.group(1).strip(), match.group(1).strip())
        where, main = _innermost(text)
        if name == "SIGABRT" and "torch/distributed/" in (main or ""):
            return "collective_timeout", _cap(
                f"SIGABRT while the main thread waited in {_short(main)} (the NCCL "
                "watchdog's abort on a collective timeout)")
        return "killed", _cap(f"{name}" + (f" in {_short(where)}" if where else ""))
    if oom_then is not None and oom_now is not None and oom_now > oom_then:
        return "killed", _cap(f"the OOM killer (the container's oom_kill count "
                              f"{oom_then} -> {oom_now})")
    return "killed", SILENT


def _innermost(text: str) -> tuple[str | None, str | None]:
    """The innermost frame of the thread the signal came on (faulthandler's "Current
    thread"; a native thread, the NCCL watchdog's, has none), and of the main thread
    (faulthandler lists it last)."""
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
              if "(most recent call first)" in b]

    def top(block: str | None) -> str | None:
        frame = re.search(r'File "([^"]+)", line \d+ in (\S+)', block or "")
        return f"{frame.group(1)}:{frame.group(2)}" if frame else None

    current = next((b for b in blocks if b.lstrip().startswith("Current thread")), None)
    main = blocks[-1] if blocks else None
    return top(current) or top(main), top(main)


def _short(where: str | None) -> str:
    if not where:
        return "?"
    path, _, fn = where.rpartition(":")
    parts = path.replace("\\", "/").split("/")
    parts = parts[parts.index("torch"):] if "torch" in parts else parts[-1:]
    return "/".join(parts) + f" ({fn})"


def _cap(text: str) -> str:
    return text[:DETAIL_CAP]
