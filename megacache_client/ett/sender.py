"""The progress step: a job's time line (`wire.progress`), sent in the background.

Rank 0 of a job attempt records facts (`ett/telemetry.py` hooks them: the start, the
first optimizer step, heartbeats, checkpoints, the end) and `ProgressSender.put`s them here. One
thread, never the trainer's, sends them in batches of up to `MAX_RECORDS` through the
client's one transport (`RemoteCache`: its deadline and retries apply; a breaker of its own,
not the node's, which stays open 30 s). Each batch ends with a sign of life at its send time
(a heartbeat), so the server never dates a killed attempt's failure before the last batch
it sent (a checkpoint's record goes out once the checkpoint is durable). A server that is
down or slow costs the trainer nothing: `put` never blocks; the queue is bounded and drops
its oldest record when full (the oldest heartbeat first: a later one says more), counting
what it dropped; a batch that could not be sent goes back to the front of the queue and is
tried again after a short pause (0.5 s, doubling up to the heartbeat period: a short
outage loses nothing and delays little); a flush cuts the pause short. A batch the server
refuses (4xx) is dropped; a server without the progress route (404/405) or a token without
the right (401/403) stops the sending for the process. Nothing is sent before `arm()`: records wait
(in the same bounded queue) until the process shows it trains.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable

from megacache_client.config import ClientConfig
from megacache_client.errors import TransportError
from megacache_client.transport.breaker import CircuitBreaker
from megacache_client.transport.client import Deadline, RemoteCache
from megacache_client.wire.progress import (
    DETAIL_CAP,
    MAX_RECORDS,
    Cause,
    PhaseSpan,
    ProgressBatch,
    ProgressRecord,
    Reason,
)

log = logging.getLogger("megacache")

QUEUE_RECORDS = 4096
"""Records kept while the server cannot take them: ~34 h of heartbeats every 30 s."""
RETRY_S = (0.5, 30.0)
"""After a batch could not be sent: wait 0.5 s, doubling (jittered +-25 %) up to the
heartbeat period or 30 s, whichever is less. A short outage costs a few seconds of delay,
not the end of the attempt's records; a long one, one try per period."""
MAX_DURATION_S = 7 * 24 * 3600.0
STOP_STATUSES = (401, 403, 404, 405)
"""A server without the progress route, or a token without the right: stop sending."""


# -- the records ----------------------------------------------------------------------------
def _duration(seconds: float | None) -> float | None:
    """A duration as the wire takes it: finite, 0 to 7 days, ms resolution."""
    if seconds is None or not math.isfinite(seconds):
        return None
    return round(min(max(seconds, 0.0), MAX_DURATION_S), 3)


def start_record(started: float, allocation_start: float | None = None) -> ProgressRecord:
    """The process started at `started`; the job's resources came at `allocation_start`
    (dropped when it is after the start: a clock or a setting that is wrong)."""
    if allocation_start is not None and not allocation_start <= started:
        allocation_start = None
    return ProgressRecord(kind="start", at=started, allocation_start=allocation_start)


def training_record(at: float, phases: list[PhaseSpan] | None = None) -> ProgressRecord:
    """The attempt's first optimizer step ended at `at`; `phases`: the spans of the way to
    it the process saw (`ett/phases.py`)."""
    return ProgressRecord(kind="training", at=at, phases=phases or None)


def heartbeat_record(at: float, step: int, data_wait_s: float | None = None
                     ) -> ProgressRecord:
    """Alive at `at`, `step` optimizer steps done, having waited `data_wait_s` for batches
    since its first step (None: not measured)."""
    return ProgressRecord(kind="heartbeat", at=at, step=max(step, 0),
                          data_wait_s=_duration(data_wait_s) or None)


def checkpoint_save_record(at: float, step: int, blocking_s: float,
                           background_s: float | None = None) -> ProgressRecord:
    """A checkpoint of `step` began at `at`, held the loop `blocking_s`, and was written
    `background_s` more off the loop."""
    return ProgressRecord(kind="checkpoint_save", at=at, step=max(step, 0),
                          blocking_s=_duration(blocking_s) or 0.0,
                          background_s=_duration(background_s))


def checkpoint_load_record(at: float, blocking_s: float, step: int | None = None
                           ) -> ProgressRecord:
    return ProgressRecord(kind="checkpoint_load", at=at, blocking_s=_duration(blocking_s) or 0.0,
                          step=None if step is None else max(step, 0))


def end_record(at: float, reason: Reason, cause: Cause | None = None,
               detail: str | None = None, exit_code: int | None = None) -> ProgressRecord:
    """The attempt ended at `at`; failed, why (`wire.progress.CAUSES`)."""
    failed = reason == "failed"
    return ProgressRecord(kind="end", at=at, reason=reason,
                          cause=(cause or "unknown") if failed else None,
                          detail=_detail(detail) if failed else None,
                          exit_code=exit_code if failed else None)


def failure_record(at: float, cause: Cause, detail: str | None = None) -> ProgressRecord:
    """What a later attempt learnt of this one's failure (sent in this attempt's name)."""
    return ProgressRecord(kind="failure", at=at, cause=cause, detail=_detail(detail))


def _detail(text: str | None) -> str | None:
    """Free text as the wire takes it: printable, at most DETAIL_CAP characters."""
    if not text:
        return None
    clean = "".join(c if c.isprintable() else " " for c in text).strip()[:DETAIL_CAP]
    return clean or None


def _older(records: list[ProgressRecord]) -> list[ProgressRecord] | None:
    """`records` as a server from before the failures' causes and the start's phases takes
    them (None: they are already): it refuses fields and kinds it does not know, and would
    lose the batch's start, first step or end with them."""
    plain = [dataclasses.replace(r, cause=None, detail=None, exit_code=None, phases=None)
             for r in records if r.kind != "failure"]
    return plain if plain and plain != records else None


# -- the queue ------------------------------------------------------------------------------
class ProgressQueue:
    """Bounded, never blocks the putter: when full, the oldest heartbeat (else the oldest
    record) is dropped and counted."""

    def __init__(self, limit: int = QUEUE_RECORDS) -> None:
        self.limit = max(1, limit)
        self.dropped = 0
        self.added = 0
        self._items: collections.deque[ProgressRecord] = collections.deque()
        self._ready = threading.Condition(threading.Lock())

    def __len__(self) -> int:
        return len(self._items)

    def put(self, record: ProgressRecord) -> None:
        with self._ready:
            self._make_room(1)
            self._items.append(record)
            self.added += 1
            self._ready.notify()

    def put_back(self, records: list[ProgressRecord]) -> None:
        """Records taken but not sent go back in front, in their order, room permitting."""
        with self._ready:
            for record in reversed(records[-self.limit:]):
                self._make_room(1)
                self._items.appendleft(record)
            self.dropped += max(0, len(records) - self.limit)

    def take(self, n: int, timeout: float) -> list[ProgressRecord]:
        """Up to `n` records, oldest first; waits up to `timeout` for the first one."""
        with self._ready:
            if not self._items:
                self._ready.wait(timeout)
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def _make_room(self, n: int) -> None:
        while len(self._items) + n > self.limit:
            old = next((r for r in self._items if r.kind == "heartbeat"), None)
            if old is not None:
                self._items.remove(old)
            else:
                self._items.popleft()
            self.dropped += 1


# -- the sender -----------------------------------------------------------------------------
class ProgressSender:
    """A job attempt's progress: `put` from any thread, sent by one daemon thread."""

    def __init__(self, config: ClientConfig, job: str, attempt: int,
                 model: Callable[[], str | None] = lambda: None,
                 queue: ProgressQueue | None = None, retry_s: float | None = None,
                 armed: bool = True, alive: Callable[[float], ProgressRecord | None]
                 = lambda _at: None) -> None:
        self.config = config
        self.job = job
        self.attempt = attempt
        self.model = model
        self.alive = alive
        """The record of being alive at a time (a heartbeat), added to each batch as it
        is sent: a batch carries its send time, and a killed attempt's failure is no
        earlier than the last batch it sent."""
        self.queue = queue or ProgressQueue()
        self.retry_s = retry_s if retry_s is not None else min(config.heartbeat_s, RETRY_S[1])
        """The longest pause after a batch could not be sent (the first is RETRY_S[0])."""
        self._backoff = RETRY_S[0]
        self.sent = 0
        self.refused = 0
        self.tries = 0
        """Batches the sender has tried to send (sent or not)."""
        self.failing = False
        """The last try to send failed (the server is down or slow): the exit does not wait."""
        self.stopped = ""
        self.earlier: list[tuple[int, ProgressRecord]] = []
        """Records of the job's earlier attempts to send once armed (their last signs)."""
        self.armed = armed
        """Nothing is sent before: records wait until the process shows it trains."""
        self._done = threading.Condition()
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Ends a pause after a failed send (a flush wants the records out now)."""
        self._thread: threading.Thread | None = None
        self._remote: RemoteCache | None = None
        """One client for the sender's life (one connection kept), a deadline per batch."""

    def start(self) -> ProgressSender:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="megacache-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def arm(self) -> None:
        """Send what was put, and from now on what is put."""
        self.armed = True

    def put(self, record: ProgressRecord | None) -> None:
        if record is not None and not self.stopped:
            self.queue.put(record)

    def put_all(self, records: Iterable[ProgressRecord]) -> None:
        for record in records:
            self.put(record)

    @property
    def settled(self) -> int:
        """Records put that are gone: sent, refused or dropped."""
        return self.sent + self.refused + self.queue.dropped

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` for what was put so far to be sent (or refused, or
        dropped); True if it was. Tries at once even after failures (a pause is cut
        short), and gives up after one more failed try: a server that is down costs a
        refused connection, one that hangs at most `timeout`. Returns at once before
        `arm()` or after `stop()`."""
        end = time.monotonic() + timeout
        target, tries = self.queue.added, self.tries
        self._wake.set()
        with self._done:
            while self.settled < target and self.armed and not self.stopped:
                left = end - time.monotonic()
                if left <= 0 or (self.tries > tries and self.failing):
                    return False
                self._done.wait(min(left, 0.05))
        return True

    def stop(self, why: str) -> None:
        self.stopped = why
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.armed:
                    self._stop.wait(0.05)
                    continue
                self._send_earlier()
                records = self.queue.take(MAX_RECORDS, 0.2)
                if not records:
                    continue
                ok = self._send(records)
                with self._done:
                    self.tries += 1
                    self._done.notify_all()
                if ok:
                    self._backoff = RETRY_S[0]
                elif not self.stopped:
                    self.queue.put_back(records)
                    self._pause()
        finally:
            if self._remote is not None:
                self._remote.close()

    def _pause(self) -> None:
        """Wait before trying again: short at first (an outage of seconds costs seconds),
        jittered (a fleet does not come back in step), cut short by a flush."""
        self._wake.clear()
        self._wake.wait(self._backoff * random.uniform(0.75, 1.25))
        self._backoff = min(self._backoff * 2, max(self.retry_s, RETRY_S[0]))

    def _alive(self, records: list[ProgressRecord]) -> list[ProgressRecord]:
        """The sign of life to send with `records`: none when the batch is full, holds the
        end, or ends with a heartbeat of the last second anyway."""
        now = time.time()
        if len(records) >= MAX_RECORDS or any(r.kind == "end" for r in records) or (
                records[-1].kind == "heartbeat" and now - records[-1].at < 1.0):
            return []
        try:
            record = self.alive(now)
        except Exception:  # a clock out of range, ...: the batch goes without
            return []
        return [record] if record is not None else []

    def _send(self, records: list[ProgressRecord]) -> bool:
        """POST one batch, with a sign of life at its send time; False when it should be
        tried again later."""
        try:
            batch = ProgressBatch(attempt=self.attempt, records=records + self._alive(records),
                                  model=self._model())
        except Exception as exc:  # nothing a retry would mend
            self.refused += len(records)
            log.info("megacache: %d progress records dropped: %s", len(records), exc)
            return True
        result = self._post(batch)
        if result == "refused" and (plain := _older(batch.records)) is not None:
            # a server from before the causes and phases: what it knows
            result = self._post(ProgressBatch(attempt=self.attempt, records=plain,
                                              model=batch.model))
        if result == "refused":
            self.refused += len(records)
        elif result == "sent":
            self.sent += len(records)
        return result != "again"

    def _send_earlier(self) -> None:
        """The last signs of the job's earlier attempts that ended without saying so
        (`ett/lifeline.py`), each as a heartbeat of its own attempt; one try each."""
        while self.earlier and self.armed and not self.stopped:
            attempt, record = self.earlier.pop(0)
            try:
                batch = ProgressBatch(attempt=attempt, records=[record], model=self._model())
            except Exception as exc:
                log.debug("megacache: an earlier attempt's last sign not sent: %s", exc)
                continue
            self._post(batch)

    def _model(self) -> str | None:
        try:
            model = self.model()
        except Exception:  # the session changing under us: the next batch names it
            return None
        return model[:256] if model else None

    def _post(self, batch: ProgressBatch) -> str:
        """One POST: "sent", "refused" (4xx: dropped), "stopped" (the server has no
        progress route, or the token no right) or "again" (to be tried again later)."""
        try:
            if self._remote is None:  # its own breaker: the node's opens for 30 s
                self._remote = RemoteCache(self.config, breaker=CircuitBreaker(
                    threshold=1, reset_s=RETRY_S[0]))
            self._remote.deadline = Deadline(self.config.load_deadline_s)
            self._remote.post_progress(self.job, batch.to_json())
        except TransportError as exc:
            status = exc.status or 0
            if status in STOP_STATUSES:
                self.stop(f"the server refused progress: {exc}")
                log.info("megacache: job progress not sent: %s", self.stopped)
                return "stopped"
            if 400 <= status < 500:
                log.info("megacache: %d progress records refused: %s", len(batch.records),
                         exc)
                return "refused"
            self.failing = True
            log.debug("megacache: progress not sent (will try again): %s", exc)
            return "again"
        except Exception as exc:  # never let telemetry break the trainer
            self.failing = True
            log.debug("megacache: progress not sent (will try again): %s: %s",
                      type(exc).__name__, exc)
            return "again"
        self.failing = False
        return "sent"
