"""Job telemetry: rank 0 tells the server where its job's time goes (Effective Training Time).

Started by `enable()` (so zero-code too), for rank 0 of a job only (a process without a job
id has no time line to add to), unless `MEGACACHE_TELEMETRY=0`. It sends nothing until the
process shows that it trains (its first optimizer step, or a checkpoint saved or loaded):
the records wait until then. A launcher that imports torch with the job's variables
(torchrun's agent: no RANK, attempt 0 for ever) or a helper script is no trainer, and its
start, heartbeats and end would spoil the job's time line; a trainer that dies before its
first step is counted by the server in the next attempt's recovery. Steps are counted by
the process since its start (a restored checkpoint's step is unknown to it). It hooks,
without a change to the trainer:

- the start: the process's start time (`start_clock`), and on attempt 0 the job's
  allocation start (`MEGACACHE_JOB_START`, `SLURM_JOB_START_TIME`);
- optimizer steps: one global step post hook (`register_optimizer_step_post_hook`) counts
  them, per optimizer (a step is the most any optimizer took: a GAN's two optimizers count
  one step each); its cost per step is a dict increment. The first step sends `training`,
  with the spans of the way to it (`phases.py`: imports, process groups, model build,
  the first batch);
- heartbeats: a daemon thread sends the step count every `heartbeat_s`;
- checkpoints: `torch.distributed.checkpoint.save`, `async_save` and `load`, timed on the
  loop and (async) in the background (`checkpoints.py`); trainers that checkpoint another
  way, or bound `save` before the client was enabled, say so with
  `megacache_client.checkpoint()` / `checkpoint_saved()` / `checkpoint_loaded()`;
- the end: `finished` at interpreter exit, `failed` on an uncaught exception
  (`sys.excepthook`, chained), on `sys.exit(n)` with n != 0 and on SIGTERM, each with its
  cause (`causes.py`: `exception`, `oom`, `collective_timeout`, `exit_code`, `preempted`).
  A process killed with SIGKILL sends nothing: the server dates its failure by the last
  thing it is known to have done, its last batch (each ends with a heartbeat at its send
  time) or its lifeline on the node (`ett/lifeline.py`), which the next attempt there
  reports, with the cause it can tell (`killed`).

Everything here is fail-open: an error is a debug line, and the sending is
`ett/sender.py`'s thread's business, never the training loop's.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from megacache_client.config import ClientConfig
from megacache_client.ett import causes
from megacache_client.ett import sender as records
from megacache_client.ett.lifeline import LIFELINE_S, Lifeline
from megacache_client.ett.phases import Phases
from megacache_client.ett.sender import ProgressSender
from megacache_client.job import JobIdentity, allocation_start
from megacache_client.job import ended as job_ended
from megacache_client.wire.progress import Cause, ProgressRecord, Reason

log = logging.getLogger("megacache")

EXIT_FLUSH_S = 2.0
"""How long the exit waits for the last records to be sent (not at all when the server
was failing already)."""
TRAINS_ON_S = 60.0
"""A SIGTERM the process outlives by this long while it trains (a handler that ignored
it) is not how its attempt ends."""

_lock = threading.Lock()
_active: Telemetry | None = None


class Telemetry:
    """One process's progress: counters the hooks touch, records `ProgressSender` sends."""

    def __init__(self, progress: ProgressSender, heartbeat_s: float,
                 lifeline: Lifeline | None = None, phases: Phases | None = None,
                 job: JobIdentity | None = None) -> None:
        self.progress = progress
        self.job = job or JobIdentity()
        self.phases = phases or Phases(time.time(), None)
        """The spans of the way to the first step, sent with it."""
        self.heartbeat_s = heartbeat_s
        self.lifeline = lifeline
        """This attempt's life on the node (`ett/lifeline.py`), renewed while it trains."""
        self.counts: dict[int, int] = {}
        self.first_step: float | None = None
        self.loop_thread: int | None = None
        """The thread that ran the first optimizer step: the training loop's."""
        self.data_wait_s = 0.0
        """Seconds the loop waited for batches since its first step (`dataloading.py`)."""
        self._restore: tuple[float, float, int | None] | None = None
        """A restore made of several calls, being added up: (start, seconds, step)."""
        self.ended: Reason | None = None
        self.exits = causes.ExitWatch()
        """`sys.exit(n)`'s code, for the end's cause (atexit cannot see it)."""
        self.sigterm_at: float | None = None
        """When SIGTERM reached the process: however it then ends, it was preempted."""
        self._stopping = threading.Event()
        self._beating = threading.RLock()
        """Held while a heartbeat is made and queued, and while the end is: a beat the end
        meets goes before it, none after. Re-entrant: the SIGTERM handler runs on the main
        thread, which may be holding it (its end then returns at once: `ended` is set)."""
        self._looked = threading.Lock()
        """Held once the earlier attempts' last signs were looked for (once a process)."""
        self._handle: Any = None
        self._previous_hook: Any = None

    @property
    def step(self) -> int:
        """Optimizer steps this process finished (the most any one optimizer took)."""
        try:
            return max(tuple(self.counts.values()), default=0)
        except RuntimeError:  # changed size while read: the loop added an optimizer
            return 0

    # -- the hooks ------------------------------------------------------------------------
    def on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The global optimizer step post hook: a counter; the first step sends `training`
        (and a restore still being added up: the trainer trains again)."""
        key = id(optimizer)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.exits.noted is not None or self.sigterm_at is not None:
            self._trains_on()
        if self.first_step is None:
            self.first_step = time.time()
            self.loop_thread = threading.get_ident()
            self.restored(None)
            self.emit(records.training_record, self.first_step, self.phases.first_step())
            self._arm()

    def _arm(self) -> None:
        """The process trains: send its time line, and look for the last signs of earlier
        attempts now, in a thread of its own (a short attempt may end before the next
        beat; what it found would then never be sent)."""
        if self.lifeline is not None and not self._looked.locked():
            threading.Thread(target=self._look_for_orphans, name="megacache-orphans",
                             daemon=True).start()
        self.progress.arm()

    def _look_for_orphans(self) -> None:
        """Once a process: the earlier attempts' last signs, queued before this attempt's
        records (a trainer reports what earlier attempts on its node left)."""
        if self.lifeline is None or not self._looked.acquire(blocking=False):
            return
        for s in self.lifeline.orphans():
            self.progress.earlier += [
                (s.attempt, records.heartbeat_record(s.at, s.step)),
                (s.attempt, records.failure_record(s.at, s.cause, s.detail))]

    def _trains_on(self) -> None:
        """A step after a `SystemExit` the trainer caught, or long after a SIGTERM it
        ignored: neither is how the attempt ends."""
        self.exits.forget()
        if self.sigterm_at is not None and time.time() - self.sigterm_at > TRAINS_ON_S:
            self.sigterm_at = None

    def first_batch(self, began: float) -> None:
        """The first DataLoader iterator, made at `began`, gave its first batch."""
        self.phases.on_first_batch(began)

    def emit(self, build: Callable[..., ProgressRecord], *args: Any) -> None:
        try:
            self.progress.put(build(*args))
        except Exception as exc:  # a clock out of range, ...: this record only
            log.debug("megacache: progress record not made: %s", exc)

    def saved(self, at: float, blocking_s: float, background_s: float | None,
              step: int | None) -> None:
        self.emit(records.checkpoint_save_record, at, self.step if step is None else step,
                  blocking_s, background_s)
        self._arm()

    def restoring(self, at: float, blocking_s: float, step: int | None) -> None:
        """One call of a restore made of several (a framework's): added up, sent once."""
        began, total, known = self._restore or (at, 0.0, None)
        self._restore = (min(began, at), total + blocking_s,
                         step if step is not None else known)

    def restored(self, step: int | None) -> None:
        """The restore being added up is complete: one record, resuming from `step`."""
        pending, self._restore = self._restore, None
        if pending is not None:
            self.loaded(pending[0], pending[1], step if step else pending[2])

    def loaded(self, at: float, blocking_s: float, step: int | None) -> None:
        """A restore: the step it resumes from is the trainer's to say (this process's
        count is not it), None when unknown."""
        self.emit(records.checkpoint_load_record, at, blocking_s, step)
        self._arm()

    def _beat(self) -> None:
        """Every `heartbeat_s` a heartbeat to the server; every `LIFELINE_S`, while the
        process trains, its lifeline on the node renewed."""
        tick = min(LIFELINE_S, self.heartbeat_s)
        due = time.monotonic() + self.heartbeat_s
        while not self._stopping.wait(tick):
            if not _rank_zero():
                self.stop("not rank 0 of the process group")
                return
            if self.lifeline is not None and self.progress.armed:
                self._look_for_orphans()
                self.lifeline.renew(time.time(), self.step)
            if time.monotonic() >= due:
                due += self.heartbeat_s
                with self._beating:
                    if self._stopping.is_set():  # the end came while this beat was due
                        return
                    self.emit(self.alive, time.time())

    # -- start and end --------------------------------------------------------------------
    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self.on_step)
        from megacache_client.ett import checkpoints, dataloading, frameworks, phases

        phases.watch(lambda: _active.phases if _active is not None else None)
        self.phases.install()
        checkpoints.watch_checkpoints(active)
        frameworks.watch()
        dataloading.watch(active)
        threading.Thread(target=self._beat, name="megacache-heartbeat", daemon=True).start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        self.exits.install()
        atexit.register(self.at_exit)
        self.progress.start()

    def _excepthook(self, kind: type[BaseException], value: BaseException,
                    tb: TracebackType | None) -> None:
        try:
            (self._previous_hook or sys.__excepthook__)(kind, value, tb)
        finally:
            cause, detail = causes.of_exception(value)
            if self.sigterm_at is not None:  # the SIGTERM came first: it ended the attempt
                cause, detail = "preempted", f"SIGTERM, then {detail}"
            self.end("failed", cause=cause, detail=detail)

    def at_exit(self) -> None:
        """Interpreter exit: finished, unless `sys.exit(n)` said otherwise or a SIGTERM
        came first."""
        cause, detail, code = self.exits.ending()
        if self.sigterm_at is not None:
            cause, detail = "preempted", "SIGTERM" + (f", then {detail}" if detail else "")
        if cause is None:
            self.end("finished")
        else:
            self.end("failed", cause=cause, detail=detail, exit_code=code or None)

    def end(self, reason: Reason, wait: float = EXIT_FLUSH_S, *, cause: Cause | None = None,
            detail: str | None = None, exit_code: int | None = None) -> None:
        """The attempt ended (why, when it failed): send `end` and wait (bounded) for the
        records to leave, even when the last sends failed (a server back from a short
        outage gets the end)."""
        if self.ended is not None or _active is not self:
            return
        self.ended = reason
        job_ended(self.job, reason)  # the node's record: the next run is a new job or not
        if not self.progress.armed:  # never trained: no trainer (a launcher, a helper)
            self.stop("the process never trained")
            return
        with self._beating:  # the last record sent: no heartbeat after it
            self._stopping.set()
            self.emit(self.alive, time.time())  # the last data wait, then the end
            self.emit(records.end_record, time.time(), reason, cause, detail, exit_code)
        if self.lifeline is not None:
            self.lifeline.end()
        self.progress.flush(wait)

    def alive(self, at: float) -> ProgressRecord:
        """Alive at `at`, `step` steps done (and the data wait so far): the sign of life
        each batch carries, and each heartbeat."""
        return records.heartbeat_record(at, self.step, self.data_wait_s)

    def preempted(self, deadline: float, ending: bool) -> None:
        """SIGTERM: a sign of life now (the attempt's `end`, failed, when the signal is about
        to end the process), sent within a second or by `deadline`.

        The end may be on its way already: a rank whose collective failed as a peer died
        raises, and its launcher's SIGTERM comes while the exception's end is sent. Handing
        the signal on at once would lose that end (the failure then dated by the last
        heartbeat, up to 30 s early), so it gets the rest of its own flush's time."""
        wait = max(0.0, min(deadline - time.monotonic(), EXIT_FLUSH_S / 2))
        self.sigterm_at = time.time()
        if self.ended is not None and self.progress.armed:
            self.progress.flush(max(0.0, min(deadline - time.monotonic(), EXIT_FLUSH_S)))
        elif ending:
            self.end("failed", wait, cause="preempted", detail="SIGTERM")
        elif self.ended is None and self.progress.armed:
            self.emit(self.alive, time.time())
            self.progress.flush(wait)

    def stop(self, why: str = "stopped") -> None:
        """No more hooks, heartbeats or sending (tests; a process found not to be rank 0)."""
        global _active
        self._stopping.set()
        self.progress.stop(why)
        if self._handle is not None:
            self._handle.remove()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        self.exits.uninstall()
        atexit.unregister(self.at_exit)
        with _lock:
            if _active is self:
                _active = None


def start(config: ClientConfig, job: JobIdentity, started: float,
          model: Callable[[], str | None] = lambda: None,
          imported: float | None = None) -> Telemetry | None:
    """Start the process's telemetry (once; later calls return the running one). None when
    it is off: `telemetry=False`, the client disabled, no job id, or not rank 0.
    `imported`: when `import torch` ended (the imports' span ends there)."""
    global _active
    with _lock:
        if _active is not None:
            return _active
        if not (config.enabled and config.telemetry) or job.job_id is None or job.rank != 0:
            return None
        progress = ProgressSender(config, job.job_id, job.attempt, model, armed=False)
        lifeline = Lifeline(config.node_cache_dir, job.job_id, job.attempt)
        telemetry = Telemetry(progress, config.heartbeat_s, lifeline,
                              Phases(started, imported), job)
        progress.alive = telemetry.alive
        alloc = allocation_start() if job.attempt == 0 else None
        telemetry.emit(records.start_record, started, alloc)
        _active = telemetry
    try:
        telemetry.install()
    except Exception:
        telemetry.stop("could not install")
        raise
    return telemetry


def active() -> Telemetry | None:
    return _active


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) is no rank 0: its copy of the hooks sends
    nothing (its threads did not survive the fork anyway)."""
    global _active
    if _active is not None:
        _active.progress.stop("forked child")
        _active.ended = "finished"
    _active = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _rank_zero() -> bool:
    """False once torch.distributed says this process is not rank 0 (a launcher whose
    rank variable the job identity does not read)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is None or not dist.is_initialized() or dist.get_rank() == 0
    except Exception:
        return True


# -- the public one-liners ------------------------------------------------------------------
def checkpoint_saved(blocking_s: float, background_s: float | None = None,
                     step: int | None = None) -> None:
    """A checkpoint just became durable: the loop waited `blocking_s` for it, and it was
    written `background_s` more in the background. Nothing when telemetry is off."""
    t = _active
    if t is not None:
        try:
            at = time.time() - blocking_s - (background_s or 0.0)
        except TypeError:
            return
        t.saved(at, blocking_s, background_s, step)


def checkpoint_loaded(blocking_s: float, step: int | None = None) -> None:
    """A checkpoint was just restored, taking `blocking_s`, resuming from `step`."""
    t = _active
    if t is not None:
        try:
            at = time.time() - blocking_s
        except TypeError:
            return
        t.loaded(at, blocking_s, step)


@contextlib.contextmanager
def checkpoint(step: int | None = None) -> Iterator[None]:
    """`with checkpoint(): save(...)`: the block's time is the loop's wait for a checkpoint
    (sent when the block ends without an exception)."""
    at, began = time.time(), time.monotonic()
    yield
    t = _active
    if t is not None:
        t.saved(at, time.monotonic() - began, None, step)
