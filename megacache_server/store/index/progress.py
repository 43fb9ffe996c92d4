"""What the index keeps of a job's progress (`ProgressStore`): a bounded summary per job
attempt, and the one rule that folds a batch of records into it, shared by every backend.

A trainer heartbeats every few seconds for weeks; the index keeps none of those records,
only what the split (`service.ett.split`) needs: the attempt's first process start, allocation
start, first training step (with the spans of the way to it the process saw), first and
last heartbeat, the latest `MAX_SAVES` checkpoint saves (older ones as a count, a sum and
histogram buckets), the latest `MAX_LOADS` loads (the same), its end and why, and what a
later attempt learnt of its failure. However many records a flood sends, an attempt's summary stays
a few KiB; a job keeps its newest `MAX_ATTEMPTS` attempts, a namespace its latest
`MAX_JOBS` jobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from megacache_client.wire.progress import MAX_PHASES, MAX_SKEW_S, MODEL_CAP, ProgressRecord
from megacache_client.wire.text import escape_foreign, is_text

MAX_SAVES = 32
"""Checkpoint saves kept one by one per attempt (the latest); older ones are aggregated."""
MAX_LOADS = 8
"""Checkpoint loads kept one by one per attempt (the latest)."""
MAX_ATTEMPTS = 64
"""Attempts kept per job (the newest numbers); an older one goes when a newer one comes."""
MAX_JOBS = 20_000
"""Jobs kept per namespace (those that reported last)."""
SAVE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Upper bounds of the checkpoint-blocking histogram (seconds); one more bucket: +Inf."""


@dataclass(frozen=True)
class Save:
    at: float
    step: int
    blocking_s: float
    background_s: float

    @property
    def durable_at(self) -> float:
        return self.at + self.blocking_s + self.background_s


@dataclass(frozen=True)
class Load:
    at: float
    blocking_s: float
    step: int | None = None


class Span(NamedTuple):
    """A part of the way to the first step, as the process saw it (`wire.PhaseSpan`)."""

    phase: str
    at: float
    seconds: float
    calls: int


@dataclass(frozen=True)
class AttemptProgress:
    """One attempt's time line, summarised. Times are the trainer's clock, as sent (the
    server refused what was too far from its own); the split clamps what it reads."""

    attempt: int
    first_at: float
    """The earliest and latest time of any record: the attempt's observed span."""
    last_at: float
    received_at: float
    """The server's clock when the last batch arrived."""
    model: str | None = None
    start_at: float | None = None
    allocation_start: float | None = None
    training_at: float | None = None
    first_heartbeat: tuple[float, int] | None = None
    last_heartbeat: tuple[float, int] | None = None
    saves: tuple[Save, ...] = ()
    saves_n: int = 0
    saves_blocking_s: float = 0.0
    first_save_at: float | None = None
    save_buckets: tuple[int, ...] = field(default=(0,) * (len(SAVE_BUCKETS) + 1))
    loads: tuple[Load, ...] = ()
    loads_n: int = 0
    loads_blocking_s: float = 0.0
    end_at: float | None = None
    end_reason: str | None = None
    records: int = 0
    data_wait: tuple[float, float] | None = None
    """(at, seconds) of the latest heartbeat that said how long the loop had waited for
    data since the first step (cumulative, so the latest says all)."""
    end_cause: str | None = None
    end_detail: str | None = None
    exit_code: int | None = None
    failure: tuple[str, str | None, float] | None = None
    """(cause, detail, at) of the failure as a later attempt learnt it: it stands before
    the end's own cause (`wire.progress` `failure`)."""
    phases: tuple[Span, ...] = ()

    def to_json(self) -> str:
        """`dataclasses.asdict` as JSON, without its recursive deep copy (60% of a
        heartbeat fold's time): the fields in order, saves and loads as objects."""
        d = dict(vars(self))
        d["saves"] = [vars(k) for k in self.saves]
        d["loads"] = [vars(k) for k in self.loads]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> AttemptProgress:
        d: dict[str, Any] = json.loads(raw)
        d["saves"] = tuple(Save(**s) for s in d["saves"])
        d["loads"] = tuple(Load(**s) for s in d["loads"])
        for name in ("first_heartbeat", "last_heartbeat", "data_wait", "failure"):
            d[name] = tuple(d[name]) if d.get(name) is not None else None
        d["phases"] = tuple(Span(*p) for p in d.get("phases", ()))
        d["save_buckets"] = tuple(d["save_buckets"])
        if d.get("model") is not None and not is_text(d["model"], MODEL_CAP):
            # Stored by a server from before the text rule (a lone surrogate breaks every
            # JSON answer that carries it): shown escaped, so no view of the namespace 500s.
            d["model"] = escape_foreign(d["model"], MODEL_CAP)
        return cls(**d)

    @property
    def failed_by_itself(self) -> bool:
        return self.end_reason == "failed"


@dataclass(frozen=True)
class JobProgress:
    """A job's attempts (oldest first), in one namespace."""

    namespace: str
    job: str
    last_seen: float
    attempts: tuple[AttemptProgress, ...]

    @property
    def model(self) -> str | None:
        return next((a.model for a in reversed(self.attempts) if a.model), None)


class JobStamps(NamedTuple):
    """What a reader needs to know whether a job's attempts changed since it read them,
    in a few numbers whatever the job's history (`ProgressStore.attempt_stamps`). Every
    write of an attempt sets its stamp (the server time of the write, in µs), so:

    - the same `prefix` (count, last attempt, sum of the other attempts' stamps): nothing
      before the last attempt changed (a sum moves when any stamp does: two stamps moving
      by exactly opposite µs at once is not a thing writes do);
    - then a different `last_stamp`: only the last attempt did (a heartbeat)."""

    attempts: int
    last: int
    """The newest attempt's number."""
    last_stamp: int | None
    others_sum: int | None
    """Sum of the other attempts' stamps (None: some has none, e.g. written by a server from
    before the stamps: such a job is read whole every time)."""

    @property
    def prefix(self) -> tuple[int, int, int] | None:
        if self.others_sum is None:
            return None
        return (self.attempts, self.last, self.others_sum)


def stamp_us(at: float) -> int:
    """An attempt's write stamp: its server receive time in whole µs."""
    return int(at * 1_000_000)


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class Fold:
    """One attempt's batch (or heartbeats coalesced by `beats_kept`) to fold in; `count`:
    the records it stands for (more than `records` when coalesced)."""

    namespace: str
    job: str
    attempt: int
    model: str | None
    records: list[ProgressRecord]
    now: float
    count: int


def beats_kept(records: list[ProgressRecord]) -> list[ProgressRecord]:
    """Of heartbeat records, those `merge` can be told instead of all of them to the same
    effect: the least and greatest by (at, step), the only ones its heartbeat rule keeps
    (first and last heartbeat; first and last time; the latest data wait)."""
    if len(records) <= 2:
        return records
    ordered = sorted(records, key=_beat)
    return [ordered[0], ordered[-1]]


def _beat(r: ProgressRecord) -> tuple[float, int]:
    return (r.at, int(r.step or 0))


def merge(state: AttemptProgress | None, attempt: int, model: str | None,
          records: list[ProgressRecord], now: float,
          count: int | None = None) -> AttemptProgress:
    """`state` (None: the attempt's first batch) with `records` folded in (`count`: how many
    records they stand for, default all). Idempotent for a batch sent twice (a client
    retrying): heartbeats keep extremes, a save or load already kept (same time and step) is
    not counted again."""
    times = [r.at for r in records]
    lives = [*times, *(alive_at(r, now) for r in records)]
    s = state or AttemptProgress(attempt=attempt, first_at=min(times), last_at=max(lives),
                                 received_at=now)
    s = replace(s, first_at=min(s.first_at, *times), last_at=max(s.last_at, *lives),
                received_at=now, model=model or s.model,
                records=s.records + (len(records) if count is None else count))
    saves, loads = list(s.saves), list(s.loads)
    buckets = list(s.save_buckets)
    for r in sorted(records, key=lambda r: r.at):
        if r.kind == "start":
            s = replace(s, start_at=_min(s.start_at, r.at),
                        allocation_start=_min(s.allocation_start, r.allocation_start))
        elif r.kind == "training":
            if r.phases and (s.training_at is None or r.at <= s.training_at):
                s = replace(s, phases=tuple(Span(p.phase, p.at, float(p.seconds), p.count)
                                            for p in r.phases[:MAX_PHASES]))
            s = replace(s, training_at=_min(s.training_at, r.at))
        elif r.kind == "heartbeat":
            beat = _beat(r)
            if s.first_heartbeat is None or beat < s.first_heartbeat:
                s = replace(s, first_heartbeat=beat)
            if s.last_heartbeat is None or beat > s.last_heartbeat:
                s = replace(s, last_heartbeat=beat)
            if r.data_wait_s is not None and (s.data_wait is None or r.at > s.data_wait[0]):
                s = replace(s, data_wait=(r.at, float(r.data_wait_s)))
        elif r.kind == "checkpoint_save":
            save = Save(r.at, int(r.step or 0), float(r.blocking_s or 0.0),
                        float(r.background_s or 0.0))
            if any(k.at == save.at and k.step == save.step for k in saves):
                continue
            saves.append(save)
            buckets[_bucket(save.blocking_s)] += 1
            s = replace(s, saves_n=s.saves_n + 1,
                        saves_blocking_s=s.saves_blocking_s + save.blocking_s,
                        first_save_at=_min(s.first_save_at, save.at))
        elif r.kind == "checkpoint_load":
            load = Load(r.at, float(r.blocking_s or 0.0), r.step)
            if any(k.at == load.at for k in loads):
                continue
            loads.append(load)
            s = replace(s, loads_n=s.loads_n + 1,
                        loads_blocking_s=s.loads_blocking_s + load.blocking_s)
        elif r.kind == "end" and (s.end_at is None or r.at >= s.end_at):
            s = replace(s, end_at=r.at, end_reason=r.reason, end_cause=r.cause,
                        end_detail=r.detail, exit_code=r.exit_code)
        elif r.kind == "failure" and r.cause is not None:
            s = replace(s, failure=(r.cause, r.detail, r.at))
    saves.sort(key=lambda k: k.at)
    loads.sort(key=lambda k: k.at)
    return replace(s, saves=tuple(saves[-MAX_SAVES:]), loads=tuple(loads[-MAX_LOADS:]),
                   save_buckets=tuple(buckets))


def alive_at(record: ProgressRecord, now: float) -> float:
    """The latest time `record` shows its attempt alive at: a checkpoint's record is sent
    once the checkpoint is durable (a save) or restored (a load), so the attempt lived until
    then, not only at its `at` (when the save began). Never past the server's clock (plus
    the skew it allows): a lying duration cannot stretch the attempt into the future."""
    done = record.at + (record.blocking_s or 0.0)
    if record.kind == "checkpoint_save":
        done += record.background_s or 0.0
    elif record.kind != "checkpoint_load":
        return record.at
    return max(record.at, min(done, now + MAX_SKEW_S))


def _bucket(seconds: float) -> int:
    return next((i for i, bound in enumerate(SAVE_BUCKETS) if seconds <= bound),
                len(SAVE_BUCKETS))
