"""SIGTERM: leave the compile and the job's time line behind, then let the signal go on.

Preemption (SLURM, Kubernetes), a scale-down and torchrun's agent stopping the ranks of a
failed attempt all send SIGTERM, and SIGKILL a grace period later (30 s by default for
each). On SIGTERM the client spends at most `term_grace_s` to finish a publish under way (or
run one, when a compile has finished and nothing is published yet), send the run's events
if they have not gone out, and send the job's progress (a last sign of life: the failure
is dated by it); then the signal goes on: to the handler that was installed before ours
(the trainer's own or a framework's), or, when that was the default action, the process
ends by SIGTERM as it would have without megacache. A handler set to ignore the signal
keeps ignoring it. The signal is never swallowed.

Python runs signal handlers on the main thread between bytecodes, so a main thread blocked
in native code (a collective waiting on a dead peer) would run ours only when the call
returns: SIGTERM would no longer end such a process. So a watcher thread reads the signal
module's wakeup file descriptor and does the work at once; when the action before ours was
the default, the watcher ends the process with SIGTERM itself if the main thread has not
run the handler by then. Forked children (DataLoader workers) inherit neither: they get the
previous disposition back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("megacache")

Work = Callable[[float, bool], None]
"""What to do by a deadline (time.monotonic()), told whether the process is about to end
(the action behind ours is the default one)."""
HANDED_ON_S = 0.5
"""How long the watcher gives the main thread to run the handler after the work is done,
before it ends a process whose main thread is stuck in native code."""

_installed: Preemption | None = None


class Preemption:
    """Our SIGTERM handler, chained in front of the one before it."""

    def __init__(self, grace_s: float, work: list[Work]) -> None:
        self.grace_s = grace_s
        self.work = work
        self.pid = os.getpid()
        self.previous: Any = signal.getsignal(signal.SIGTERM)
        self.done = threading.Event()
        self.handed_on = threading.Event()
        self._once = threading.Lock()
        self._wakeup: tuple[int, int] | None = None

    @property
    def ends_process(self) -> bool:
        """The action behind ours is the default: the process ends once we hand it on."""
        return self.previous == signal.SIG_DFL

    # -- the work, once --------------------------------------------------------------------
    def run_work(self) -> None:
        """Everything `work` asks, within the grace, once (the watcher and the handler may
        both get here: the second waits for the first)."""
        if not self._once.acquire(blocking=False):
            self.done.wait(self.grace_s + 1.0)
            return
        deadline = time.monotonic() + self.grace_s
        try:
            for work in self.work:
                if time.monotonic() >= deadline:
                    break
                try:
                    work(deadline, self.ends_process)
                except Exception as exc:  # the signal goes on whatever happened here
                    log.debug("megacache: on SIGTERM: %s: %s", type(exc).__name__, exc)
        finally:
            self.done.set()

    # -- the handler (main thread) ---------------------------------------------------------
    def handle(self, signum: int, frame: FrameType | None) -> Any:
        if os.getpid() == self.pid:
            log.info("megacache: SIGTERM: finishing the publish and the job's progress "
                     "(at most %.1fs) before the signal goes on", self.grace_s)
            self.run_work()
        self.handed_on.set()
        return self.hand_on(signum, frame)

    def hand_on(self, signum: int, frame: FrameType | None) -> Any:
        previous = self.previous
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the default: end as without us
        os.kill(os.getpid(), signal.SIGTERM)
        return None

    # -- the watcher (a thread) ------------------------------------------------------------
    def watch(self) -> None:
        """Read the wakeup fd; on SIGTERM do the work now and, where the default action
        was to end the process, end it if the main thread cannot run the handler."""
        if self._wakeup is None:
            return
        read_end = self._wakeup[0]
        while True:
            try:
                data = os.read(read_end, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM not in data or os.getpid() != self.pid:
                continue
            ours = signal.getsignal(signal.SIGTERM) == self.handle
            self.run_work()
            # ours still the handler, the default behind it, and the main thread cannot
            # run it: end the process as SIGTERM would have (a trainer that installed a
            # handler of its own after ours decides for itself)
            if ours and self.previous == signal.SIG_DFL \
                    and not self.handed_on.wait(HANDED_ON_S):
                _end_by_sigterm()
            return

    def start_watcher(self) -> None:
        """Take the wakeup fd if nobody else has (asyncio may); else the handler alone."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        try:
            old = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = -2
        if old != -1:
            if old >= 0:
                signal.set_wakeup_fd(old)
            os.close(read_end)
            os.close(write_end)
            return
        self._wakeup = (read_end, write_end)
        threading.Thread(target=self.watch, name="megacache-sigterm", daemon=True).start()

    def release_in_child(self) -> None:
        """A forked child: the previous disposition back, the wakeup fd given up (its
        writes would reach the parent's watcher)."""
        try:
            if self._wakeup is not None:
                signal.set_wakeup_fd(-1)
                for fd in self._wakeup:
                    os.close(fd)
            if signal.getsignal(signal.SIGTERM) == self.handle:
                signal.signal(signal.SIGTERM, self.previous)
        except (ValueError, OSError):
            return


def _end_by_sigterm() -> None:
    """End this process as SIGTERM's default action would, from a thread other than the
    main one (which Python's `signal.signal` refuses): the C library resets the action."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signal.SIGTERM, None)  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    finally:
        os._exit(128 + signal.SIGTERM)


def install(grace_s: float, work: list[Work]) -> Preemption | None:
    """Put our SIGTERM handler in front of the current one (once per process; from the
    main thread only, as Python requires). None where it cannot be (another thread,
    Windows)."""
    global _installed
    if _installed is not None:
        _installed.work = work
        return _installed
    if sys.platform == "win32" or threading.current_thread() is not threading.main_thread():
        return None
    p = Preemption(grace_s, work)
    try:
        signal.signal(signal.SIGTERM, p.handle)
    except (ValueError, OSError) as exc:
        log.debug("megacache: no SIGTERM handler: %s", exc)
        return None
    if p.previous == signal.SIG_DFL:
        p.start_watcher()
    _installed = p
    return p


def _forget_in_child() -> None:
    global _installed
    if _installed is not None:
        _installed.release_in_child()
    _installed = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
