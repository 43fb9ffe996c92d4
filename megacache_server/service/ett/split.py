"""Effective Training Time: a job's wall time split into what it was spent on. Pure: facts
in (`JobProgress`, compile seconds per attempt from the events), figures out.

Every second of a job's wall time (from its allocation, or its first process start, to
the last fact any attempt reported) gets exactly one category, the first of these that
covers it:

  checkpoint_restore  a checkpoint load's blocking time
  checkpoint_save     a checkpoint save's blocking time (the loop waited on it)
  compile             the attempt's compile seconds, just before its first step
  lost_progress       training a failure threw away: from the last durable checkpoint's
                      snapshot (its `at`; the loop went on at `at + blocking_s`) to the
                      failure; a checkpoint is durable at `at + blocking_s + background_s`
  training            from the attempt's first optimizer step to its last fact
  data_wait           of that training, the seconds the loop waited for its next batch
                      (a sum the heartbeats carry, not intervals: taken from training
                      between the first step and the heartbeat that said it, the same
                      share of each training segment; DATA_LOADING_SYNC in goodput)
  recovery            from a failure (the failed attempt's last fact) to the next
                      attempt's first step
  startup             the first attempt: from allocation (or process start) to its first step
  idle                anything else (gaps nobody reported; data loading we do not measure)

So the categories sum to the wall time, none is negative, and ETT% = training / wall can
never pass 100: a trainer that lies about its times can only move its own job's seconds
between categories, within the span its records cover. An attempt failed when a later one
exists or it ended with reason `failed`; a live attempt has not failed. A failed attempt's
cause (`causes.cause_of`) is what its end said, else what a later attempt learnt of it, else
`lost` (no end, nothing later from its node); its unsaved training is its lost_progress,
its recovery the next attempt's time to recover. Each start and recovery is split into
its components (`ett_components`).

The last attempt is painted from where the attempts before it ended: a restart that
reports times inside its predecessors' span (a skewed clock, a late record) cannot repaint
seconds they already account for. So the split of the attempts before the last
(`prefix`) does not change while the last one heartbeats, and a reader that keeps it
splits a job in the work of one attempt (`join`), whatever its history.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megacache_server.service.ett import components as ett_components
from megacache_server.service.ett.causes import cause_of, cause_rows
from megacache_server.store.index.progress import AttemptProgress, JobProgress

CATEGORIES = ("training", "data_wait", "startup", "compile", "checkpoint_save",
              "checkpoint_restore", "lost_progress", "recovery", "idle")
_PRIORITY = ("checkpoint_restore", "checkpoint_save", "compile", "lost_progress",
             "training", "recovery", "startup")
"""Highest first: what a second covered by several intervals counts as."""
LIVE_S = 300.0
"""An attempt that has not ended and reported within this long (server clock) is live."""

Segment = tuple[float, float, str]


@dataclass
class AttemptSplit:
    attempt: int
    start: float
    end: float
    seconds: dict[str, float]
    failed: bool
    live: bool
    ended: str | None
    time_to_start_s: float | None
    time_to_recover_s: float | None
    saves: int
    loads: int
    save_interval: tuple[float, int] | None
    """(seconds from the first to the last save, intervals between them): the mean time
    between saves, summed over attempts before dividing."""
    save_buckets: tuple[int, ...] = ()
    """Saves by blocking seconds, as reported (`progress.SAVE_BUCKETS`, then +Inf)."""
    saves_blocking_s: float = 0.0
    cause: str | None = None
    """Why it failed (`wire.progress.CAUSES`; None: it did not)."""
    cause_detail: str | None = None
    exit_code: int | None = None
    components: dict[str, Any] | None = None
    """Its time to start or to recover, by component (`ett_components`)."""

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def row(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "start": self.start, "end": self.end,
                "wall_s": _r(self.wall_s), "seconds": {k: _r(v) for k, v in
                                                       self.seconds.items()},
                "ett_pct": ett_pct(self.seconds), "failed": self.failed, "live": self.live,
                "ended": self.ended, "time_to_start_s": _r(self.time_to_start_s),
                "time_to_recover_s": _r(self.time_to_recover_s),
                "lost_s": _r(self.seconds["lost_progress"]) if self.failed else None,
                "checkpoint_saves": self.saves, "checkpoint_loads": self.loads,
                "checkpoint_blocking_s": _r(self.seconds["checkpoint_save"]),
                "checkpoint_restore_s": _r(self.seconds["checkpoint_restore"]),
                "cause": self.cause, "cause_detail": self.cause_detail,
                "exit_code": self.exit_code, "components": self.components}


@dataclass(frozen=True)
class JobTotals:
    """A job's figures summed over its attempts: worked out once per split and read by
    every report over many jobs (a dashboard of 1,000 jobs of 64 attempts reads 1,000 of
    these, not 64,000 attempts)."""

    seconds: dict[str, float]
    failures: int
    saves: int
    save_interval_s: float
    """Seconds between each attempt's first and last save, summed (`AttemptSplit`)."""
    save_intervals: int
    recoveries: list[float]
    lost_per_failure: list[float]
    by_cause: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    """Per cause of its failures: (failures, unsaved training s, recovery s)."""


@dataclass
class JobSplit:
    namespace: str
    job: str
    model: str | None
    last_seen: float
    attempts: list[AttemptSplit]
    segments: list[Segment] = field(default_factory=list)

    @functools.cached_property
    def totals(self) -> JobTotals:
        spans = [a.save_interval for a in self.attempts if a.save_interval
                 and a.save_interval[1]]
        return JobTotals(
            seconds=total(a.seconds for a in self.attempts),
            failures=sum(a.failed for a in self.attempts),
            saves=sum(a.saves for a in self.attempts),
            save_interval_s=sum(s for s, _ in spans), save_intervals=sum(n for _, n in spans),
            recoveries=[a.time_to_recover_s for a in self.attempts[1:]
                        if a.time_to_recover_s is not None],
            lost_per_failure=[a.seconds["lost_progress"] for a in self.attempts if a.failed],
            by_cause=by_cause(self.attempts))

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per category over the job (read only: shared by every reader)."""
        return self.totals.seconds

    @property
    def live(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].live

    @property
    def start(self) -> float | None:
        return self.attempts[0].start if self.attempts else None

    @property
    def end(self) -> float | None:
        return self.attempts[-1].end if self.attempts else None

    def lost_per_failure(self) -> list[float]:
        return self.totals.lost_per_failure

    @property
    def time_to_start_s(self) -> float | None:
        return self.attempts[0].time_to_start_s if self.attempts else None

    def recoveries(self) -> list[float]:
        """Time to recover of each attempt after a failure that reached its first step."""
        return self.totals.recoveries

    def within(self, since: float, until: float) -> dict[str, float]:
        """The job's seconds within [since, until] (`clip`; the totals when it lies
        inside)."""
        if self.start is not None and self.end is not None and since <= self.start \
                and self.end <= until:
            return dict(self.seconds)
        return clip(self.segments, since, until)

    def row(self, *, attempts: bool = True) -> dict[str, Any]:
        seconds = self.seconds
        wall = sum(seconds.values())
        row = {"namespace": self.namespace, "job_id": self.job, "model": self.model,
               "last_seen": self.last_seen, "live": self.live,
               "start": self.start, "end": self.end,
               "wall_s": _r(wall), "ett_pct": ett_pct(seconds),
               **report_figures(seconds, self.time_to_start_s, self.recoveries()),
               "seconds": {k: _r(v) for k, v in seconds.items()},
               "failures": self.totals.failures,
               "failures_by_cause": cause_rows(self.totals.by_cause),
               "lost_s_per_failure": [_r(x) for x in self.lost_per_failure()]}
        if attempts:
            row["attempts"] = [a.row() for a in self.attempts]
        return row


def by_cause(attempts: list[AttemptSplit]) -> dict[str, tuple[int, float, float]]:
    """Per cause: the failures, the training they threw away (each failed attempt's
    lost_progress) and the recovery they cost (the next attempt's time to recover)."""
    out: dict[str, tuple[int, float, float]] = {}
    for i, a in enumerate(attempts):
        if not a.failed:
            continue
        later = attempts[i + 1].time_to_recover_s if i + 1 < len(attempts) else None
        n, lost, recovery = out.get(a.cause or "unknown", (0, 0.0, 0.0))
        out[a.cause or "unknown"] = (n + 1, lost + a.seconds["lost_progress"],
                                     recovery + (later or 0.0))
    return out


def report_figures(seconds: dict[str, float], time_to_start_s: float | None,
                   recoveries: list[float]) -> dict[str, Any]:
    """A job's figures in the words of the Meta/PyTorch ETT report, the same wherever they
    are shown (the job's ETT, `/v1/jobs`, the dashboard, `megacache jobs`): time to start
    (attempt 0: allocation or process start to its first optimizer step), time to recover
    (each failure to the next attempt's first step; summed), checkpoint save time (the
    seconds saves blocked the loop), unsaved training time (training the failures threw
    away)."""
    return {"time_to_start_s": _r(time_to_start_s),
            "time_to_recover_s": _r(sum(recoveries)) if recoveries else None,
            "recoveries": len(recoveries),
            "checkpoint_save_s": _r(seconds["checkpoint_save"]),
            "unsaved_training_s": _r(seconds["lost_progress"])}


def split(job: JobProgress, *, compile_s: dict[int, float] | None = None,
          now: float | None = None) -> JobSplit:
    """The job's wall time, split per attempt (see the module's rules): the attempts but
    the last (`prefix`), then the last from where they ended (`join`)."""
    attempts, compile_s = list(job.attempts), compile_s or {}
    if not attempts:
        return JobSplit(job.namespace, job.job, job.model, job.last_seen, [])
    return join(job, prefix(attempts[:-1], compile_s), attempts[-1], compile_s, now)


@dataclass(frozen=True)
class Prefix:
    """The split of a job's attempts but its last, every one failed (a later one exists):
    what stays the same while only the last attempt reports, so a reader that keeps it
    splits a heartbeating job in the work of one attempt (`join`), not of its history."""

    end: float | None
    """Where the last of them ended (None: no attempts)."""
    segments: list[Segment]
    splits: list[AttemptSplit]
    model: str | None


def prefix(attempts: list[AttemptProgress], compile_s: dict[int, float]) -> Prefix:
    """`Prefix` of `attempts` (a job's attempts but its last, oldest first)."""
    run = _run(attempts, compile_s, None, last_failed=True)
    return Prefix(max((hi for _, hi in run.spans), default=None), run.segments, run.splits,
                  next((a.model for a in reversed(attempts) if a.model), None))


def join(job: JobProgress, before: Prefix, last: AttemptProgress,
         compile_s: dict[int, float], now: float | None) -> JobSplit:
    """`split` of a job whose attempts are `before`'s and then `last`: `last` painted from
    `before.end` on (its recovery starts there; anything it reported earlier, the attempts
    before it already account for), its segments after theirs."""
    tail = _run([last], compile_s, now, last_failed=None, first=len(before.splits),
                after=before.end)
    segments = list(before.segments)
    head = tail.segments[:1]
    if segments and head and segments[-1][2] == head[0][2] and segments[-1][1] == head[0][0]:
        segments[-1] = (segments[-1][0], head[0][1], head[0][2])  # as one painting merges
        segments += tail.segments[1:]
    else:
        segments += tail.segments
    return JobSplit(job.namespace, job.job, last.model or before.model, job.last_seen,
                    [*before.splits, *tail.splits], segments)


class _Run(NamedTuple):
    splits: list[AttemptSplit]
    segments: list[Segment]
    spans: list[tuple[float, float]]


def _run(attempts: list[AttemptProgress], compile_s: dict[int, float], now: float | None,
         *, last_failed: bool | None, first: int = 0, after: float | None = None) -> _Run:
    """Split consecutive attempts of one job, painted in one pass: `first` is the first
    one's place in the job, `after` (for first > 0) the end of everything before it (its
    recovery starts there, nothing of it is painted before); `last_failed` True when a
    later attempt exists, None when the last one is the job's last (failed only by its
    own end reason)."""
    if not attempts:
        return _Run([], [], [])
    spans = [_span(a, first=first + i == 0) for i, a in enumerate(attempts)]
    prev_end = [after, *(hi for _, hi in spans[:-1])]
    lo = after if after is not None else spans[0][0]
    wall = (lo, max(lo, *(hi for _, hi in spans)))
    failed = [i < len(attempts) - 1 or bool(last_failed) or a.end_reason == "failed"
              for i, a in enumerate(attempts)]
    intervals: list[Segment] = []
    reclassify: list[tuple[float, float, float, str]] = []
    for i, (a, (lo, hi)) in enumerate(zip(attempts, spans, strict=True)):
        intervals += _intervals(a, lo, hi, failed[i], compile_s.get(a.attempt, 0.0),
                                recover_from=prev_end[i])
        dropped = a.saves_blocking_s - sum(s.blocking_s for s in a.saves)
        if dropped > 0 and a.saves:  # saves older than the kept ones: their sum only
            reclassify.append((a.training_at or lo, a.saves[0].at, dropped,
                               "checkpoint_save"))
        if a.data_wait is not None and a.training_at is not None:
            reclassify.append((a.training_at, min(a.data_wait[0], hi), a.data_wait[1],
                               "data_wait"))
    segments = _paint(intervals, *wall)
    for start, end, seconds, category in reclassify:
        segments = _convert(segments, start, end, seconds, category)
    starts = [s for s, _, _ in segments]
    edges = [wall[0], *_cummax([hi for _, hi in spans[:-1]]), wall[1]]
    splits = []
    for i, a in enumerate(attempts):
        zone = (max(edges[i], wall[0]), max(edges[i + 1], edges[i]))
        splits.append(_attempt(a, first + i, zone, spans[i], prev_end[i], failed[i],
                               _clip_sorted(segments, starts, *zone), now,
                               compile_s.get(a.attempt, 0.0)))
    return _Run(splits, segments, spans)


def _span(a: AttemptProgress, *, first: bool) -> tuple[float, float]:
    lo = a.first_at
    if first and a.allocation_start is not None:
        lo = min(lo, a.allocation_start)
    return lo, max(lo, a.last_at)


def _intervals(a: AttemptProgress, lo: float, hi: float, failed: bool, compile_s: float,
               recover_from: float | None) -> list[Segment]:
    train = _clamp(a.training_at, lo, hi)
    ready = train if train is not None else hi
    out: list[Segment] = [(recover_from, ready, "recovery") if recover_from is not None
                          else (lo, ready, "startup")]
    if train is not None:
        out.append((train, hi, "training"))
        if compile_s > 0:
            out.append((max(lo, train - compile_s), train, "compile"))
        if failed:
            out.append((_snapshot(a, hi, train), hi, "lost_progress"))
    out += [(s.at, s.at + s.blocking_s, "checkpoint_save") for s in a.saves]
    out += [(k.at, k.at + k.blocking_s, "checkpoint_restore") for k in a.loads]
    return [(max(s, lo if c != "recovery" else s), min(e, hi), c) for s, e, c in out]


def _snapshot(a: AttemptProgress, failure: float, train: float) -> float:
    """Where the training a failure lost begins: the snapshot of the last checkpoint durable
    by the failure, else the attempt's first step (it resumed from an older checkpoint)."""
    durable = [s for s in a.saves if s.durable_at <= failure]
    if durable:
        return max(train, durable[-1].at)
    if a.saves_n > len(a.saves):  # durable ones were dropped: the kept ones came after
        return max(train, a.saves[0].at)
    return train


def _clamp(t: float | None, lo: float, hi: float) -> float | None:
    return None if t is None else min(max(t, lo), hi)


def _paint(intervals: list[Segment], lo: float, hi: float,
           priority: tuple[str, ...] = _PRIORITY, rest: str = "idle") -> list[Segment]:
    """Each second of [lo, hi] under the highest-priority interval covering it (else
    `rest`), as merged segments: a sweep over the intervals' edges."""
    edges: list[tuple[float, int, str]] = []
    for s, e, c in intervals:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            edges += [(s, 1, c), (e, -1, c)]
    edges.sort(key=lambda x: x[0])
    active = dict.fromkeys(priority, 0)
    out: list[Segment] = []
    at = lo
    for t, delta, c in [*edges, (hi, 0, rest)]:
        if t > at:
            now = next((p for p in priority if active[p] > 0), rest)
            if out and out[-1][2] == now and out[-1][1] == at:
                out[-1] = (out[-1][0], t, now)
            else:
                out.append((at, t, now))
            at = t
        if delta:
            active[c] += delta
    return out


def _convert(segments: list[Segment], start: float, end: float, seconds: float,
             category: str) -> list[Segment]:
    """Up to `seconds` of training within [start, end] counted as `category` (saves too old
    to be kept one by one; the loop's wait for data), the same share of each training
    segment there. The loop's wait for data is spread over the lost training too (the loop
    waited there as well), and only training's share of it is taken."""
    spread = ("training", "lost_progress") if category == "data_wait" else ("training",)
    inside = sum(min(e, end) - max(s, start) for s, e, c in segments
                 if c in spread and e > start and s < end)
    if inside <= 0:
        return segments
    share = min(1.0, seconds / inside)
    out: list[Segment] = []
    for s, e, c in segments:
        if c != "training" or e <= start or s >= end:
            out.append((s, e, c))
            continue
        a, b = max(s, start), min(e, end)
        cut = b - (b - a) * share
        out += [x for x in ((s, cut, "training"), (cut, b, category),
                            (b, e, "training")) if x[1] > x[0]]
    return out


def _cummax(values: list[float]) -> list[float]:
    out, top = [], -math.inf
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def _attempt(a: AttemptProgress, i: int, zone: tuple[float, float],
             span: tuple[float, float], prev_end: float | None, failed: bool,
             seconds: dict[str, float], now: float | None,
             compile_s: float = 0.0) -> AttemptSplit:
    lo, hi = span
    train = _clamp(a.training_at, lo, hi)
    live = (not failed and a.end_at is None and now is not None
            and now - a.received_at <= LIVE_S)
    saves = sorted(a.saves, key=lambda s: s.at)
    interval = ((saves[-1].at - a.first_save_at, a.saves_n - 1)
                if a.saves_n > 1 and saves and a.first_save_at is not None else None)
    cause, detail = cause_of(a, failed)
    begin = prev_end if prev_end is not None else lo if i == 0 else None
    parts = (ett_components.components(a, begin, max(begin, train),
                                       recovering=prev_end is not None,
                                       compile_s=compile_s)
             if begin is not None and train is not None else None)
    return AttemptSplit(
        attempt=a.attempt, start=zone[0], end=zone[1], seconds=seconds,
        failed=failed, live=live, ended=a.end_reason,
        time_to_start_s=train - lo if i == 0 and train is not None else None,
        time_to_recover_s=(max(0.0, train - prev_end)
                           if prev_end is not None and train is not None else None),
        saves=a.saves_n, loads=a.loads_n, save_interval=interval,
        save_buckets=a.save_buckets, saves_blocking_s=a.saves_blocking_s,
        cause=cause, cause_detail=detail, exit_code=a.exit_code if failed else None,
        components=parts)


def _clip_sorted(segments: list[Segment], starts: list[float], lo: float,
                 hi: float) -> dict[str, float]:
    """`clip` of painted segments (in order, not overlapping; `starts` their starts): only
    those that can reach [lo, hi] are looked at, so an attempt's zone costs its own
    segments, not the job's."""
    first = max(0, bisect.bisect_right(starts, lo) - 1)
    last = bisect.bisect_left(starts, hi)
    return clip(segments[first:last], lo, hi)


def clip(segments: list[Segment], lo: float, hi: float) -> dict[str, float]:
    """Seconds per category of the segments within [lo, hi] (a window, an attempt's zone)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for s, e, c in segments:
        if e > lo and s < hi:
            out[c] += min(e, hi) - max(s, lo)
    return out


def total(parts: Any) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for seconds in parts:
        for k, v in seconds.items():
            out[k] += v
    return out


def ett_pct(seconds: dict[str, float]) -> float | None:
    """Training over wall time, in percent (None for no wall time); never above 100."""
    wall = sum(seconds.values())
    return round(min(100.0, 100.0 * seconds["training"] / wall), 3) if wall > 0 else None


def _r(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None
