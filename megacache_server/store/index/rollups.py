"""How events fold into rollups, the same on every index backend.

A run reported as an event adds its counters to a running total per (namespace, model),
to an hourly and a daily rollup, and (when it did not start warm) to a count of its miss
reason. Reports then add up whole days from the daily rollups and the ends of a window from
the hourly ones. What a tenant can invent (model names, reasons) is bounded per namespace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from megacache_client.wire.events import OUTCOMES, REPLAYS, Event

BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0,
           300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0, 3600.0)
"""Upper bounds (seconds) of the job histograms' buckets, +Inf after the last: a warm start
takes seconds, a cold one minutes, a bad one an hour."""
HISTOGRAMS = ("start", "recover", "compile")
"""Per job attempt, the slowest rank's: time to start (attempt 0, or a run without a job),
time to recover (later attempts), compile seconds (every attempt)."""


def bucket_counter(histogram: str, index: int) -> str:
    return f"{histogram}_b{index:02d}"


BUCKET_COUNTERS = {h: tuple(bucket_counter(h, i) for i in range(len(BUCKETS) + 1))
                   for h in HISTOGRAMS}
"""Each histogram's bucket counter names, the +Inf bucket's last."""
HISTOGRAM_COUNTERS = tuple(name for h in HISTOGRAMS
                           for name in (*BUCKET_COUNTERS[h], f"{h}_count", f"{h}_sum"))


def bucket_counts(counters: Mapping[str, float], histogram: str) -> list[float]:
    """A histogram's bucket counts (not cumulative, +Inf's last) out of summed counters."""
    return [counters[name] for name in BUCKET_COUNTERS[histogram]]
SPLIT = ("import", "fetch", "load", "compile", "rest")
"""The parts of a run's time to start clients report (`Event.tts_{part}_s`)."""
JOB_COUNTERS = ("attempts", "restarts", *HISTOGRAM_COUNTERS,
                *(f"split_{p}_s" for p in SPLIT), "split_n")
"""Job attempts (each counted once however many ranks report), restarts (attempts after the
first), the histograms' bucket counts (not cumulative), counts and sums; and the sums of
the time-to-start split over the runs that reported one (split_n)."""


def replay_counter(replay: str) -> str:
    return f"replay_{replay}"


REPLAY_COUNTERS = tuple(replay_counter(r) for r in REPLAYS)
"""Runs that replayed the entry's artifacts fully, partly, or rebuilt (`Event.replay`); a
run whose event does not say (an older client, a process's later tracks) counts in none."""
COUNTERS = ("runs", *OUTCOMES, "compile_s", "saved_s", "bytes_down", "bytes_up", "tts_s",
            "tts_n", *JOB_COUNTERS, *REPLAY_COUNTERS)
"""What every rollup row adds up. Stored as floats: sums of bounded values never overflow.
Counters added later go last (an older SQLite file gets them as columns in this order)."""


def bucket_of(seconds: float) -> int:
    """The index of the bucket `seconds` falls in (len(BUCKETS): the +Inf one)."""
    for i, bound in enumerate(BUCKETS):
        if seconds <= bound:
            return i
    return len(BUCKETS)


@dataclass(frozen=True)
class AttemptState:
    """What the index keeps of one (namespace, job, attempt): the slowest rank's time so far
    (and that rank's outcome), the most compile seconds any rank spent, and where its
    counters went (the model row and hour of its first report: every later change to it
    moves counts within that row)."""

    model: str
    hour: int
    outcome: str
    tts_s: float | None
    compile_s: float
    reports: int
    world_size: int | None
    first_seen: float
    last_seen: float


def _observe(deltas: dict[str, float], histogram: str, old: float | None,
             new: float | None) -> None:
    """Move one attempt's value in `histogram` from `old` to `new` (None: not counted)."""
    if new is None or (old is not None and new <= old):
        return
    if old is None:
        deltas[f"{histogram}_count"] = deltas.get(f"{histogram}_count", 0.0) + 1.0
    else:
        key = bucket_counter(histogram, bucket_of(old))
        deltas[key] = deltas.get(key, 0.0) - 1.0
    key = bucket_counter(histogram, bucket_of(new))
    deltas[key] = deltas.get(key, 0.0) + 1.0
    deltas[f"{histogram}_sum"] = deltas.get(f"{histogram}_sum", 0.0) + new - (old or 0.0)


def attempt_update(prev: AttemptState | None, event: Event, model: str, hour: int,
                   now: float) -> tuple[AttemptState, dict[str, float]]:
    """One report of a job attempt: the attempt's new state, and the counter changes (some
    negative: a bucket the attempt leaves) for the rollup rows of `state.model` and
    `state.hour`. A run without a job is an attempt 0 of its own, reported once."""
    tts = event.tts_s
    deltas: dict[str, float] = {}
    histogram = "recover" if event.job_id is not None and (event.attempt or 0) > 0 \
        else "start"
    if event.followup and prev is not None:  # counted with the run's first event
        return replace(prev, last_seen=max(prev.last_seen, now)), deltas
    if prev is None:
        deltas["attempts"] = 1.0
        if histogram == "recover":
            deltas["restarts"] = 1.0
        state = AttemptState(model, hour, event.outcome, tts, event.compile_s, 1,
                             event.world_size, now, now)
        _observe(deltas, histogram, None, tts)
        _observe(deltas, "compile", None, event.compile_s)
        return state, deltas
    slower = tts is not None and (prev.tts_s is None or tts > prev.tts_s)
    _observe(deltas, histogram, prev.tts_s, tts)
    _observe(deltas, "compile", prev.compile_s, event.compile_s)
    state = replace(prev, outcome=event.outcome if slower else prev.outcome,
                    tts_s=tts if slower else prev.tts_s,
                    compile_s=max(prev.compile_s, event.compile_s), reports=prev.reports + 1,
                    world_size=event.world_size or prev.world_size,
                    last_seen=max(prev.last_seen, now))
    return state, deltas


def quantile(buckets: list[float], q: float) -> float | None:
    """The `q` quantile of a histogram's (non-cumulative) bucket counts, interpolated
    linearly within the bucket it falls in, as Prometheus's histogram_quantile does (the
    +Inf bucket answers its lower bound). None without observations."""
    total = sum(buckets)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, count in enumerate(buckets):
        if count > 0 and seen + count >= rank:
            if i == len(BUCKETS):
                return BUCKETS[-1]
            low = BUCKETS[i - 1] if i else 0.0
            return low + (BUCKETS[i] - low) * max(0.0, rank - seen) / count
        seen += count
    return BUCKETS[-1]


def counts_miss(event: Event) -> bool:
    """Whether the event adds to its model's miss reasons: a run that did not start warm
    (its follow-up adds nothing: its first event counted it)."""
    return event.outcome not in ("hit", "fallback") and not event.followup


def event_counters(event: Event) -> dict[str, float]:
    """The increments one event adds to its rollup rows (its job attempt's are
    `attempt_update`'s). A follow-up adds only its compile seconds and bytes: its run,
    outcome, replay and time to start were counted with its first event."""
    counters = dict.fromkeys(COUNTERS, 0.0)
    counters.update(compile_s=event.compile_s, bytes_down=float(event.bytes_down),
                    bytes_up=float(event.bytes_up))
    if event.followup:
        return counters
    tts = getattr(event, "tts_s", None)
    counters.update(runs=1.0, saved_s=event.saved_s)
    counters[event.outcome] = 1.0
    if event.replay is not None:
        counters[replay_counter(event.replay)] = 1.0
    if tts is not None:
        counters.update(tts_s=float(tts), tts_n=1.0)
    parts = {p: getattr(event, f"tts_{p}_s", None) for p in SPLIT}
    if any(v is not None for v in parts.values()):
        counters["split_n"] = 1.0
        for p, v in parts.items():
            counters[f"split_{p}_s"] = float(v or 0.0)
    return counters


HOUR = 3600
DAY = 24 * HOUR


def merged(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two sets of counters added field by field (a rollup plus an event's deltas)."""
    out = dict(a)
    for name, value in b.items():
        out[name] = out.get(name, 0.0) + value
    return out


def hour_of(ts: float) -> int:
    return int(ts // HOUR * HOUR)


@dataclass(frozen=True)
class Window:
    """Which rollups add up to the time since some moment: whole UTC days from the daily
    rollups, today included (its daily row is kept up to date as events arrive, so it holds
    exactly today's hours so far), and only the first, partial day from the hourly ones. A
    week of 200 models is ~6k rows to sum instead of ~34k, and a year ~73k instead of
    1.75M."""

    first_hour: int
    day_start: int
    day_end: int
    last_hour: int

    @property
    def hours(self) -> list[int]:
        """Hour starts summed from hourly rollups."""
        return [*range(self.first_hour, self.day_start, HOUR),
                *range(self.day_end, self.last_hour + 1, HOUR)]

    @property
    def days(self) -> list[int]:
        return list(range(self.day_start, self.day_end, DAY))


def window(since: float, now: float, *, days: bool = True, days_from: float = 0.0) -> Window:
    """The window from `since` to `now`; `days=False` keeps hourly resolution throughout,
    and no day before `days_from` (when daily rollups began) is read from them."""
    first, last = hour_of(since), hour_of(now)
    day_start = -(-max(first, int(days_from)) // DAY) * DAY
    day_end = last // DAY * DAY + DAY  # through today
    if not days or day_end <= day_start:
        return Window(first, first, first, last)
    return Window(first, day_start, day_end, last)


EVENT_BACKDATE_S = 30 * 24 * 3600

MAX_MODELS = 2000
"""Distinct model names one namespace's rollups keep; events of further models count under
OTHER_MODELS. A model name is whatever a client sends: without a bound, one tenant posting
a new name with every event (20/s is 1.7M a day) would grow everyone's `/metrics` (~80
series per model), the admin's stats and dashboard without end."""
OTHER_MODELS = "(other models)"
MAX_REASONS = 1000
"""Distinct (model, outcome, reason) miss rows one namespace keeps per hour and per day;
further reasons count under OTHER_REASONS, so a flood of unique reasons costs the top-misses
table a bounded number of rows."""
OTHER_REASONS = "(other reasons)"
MAX_JOBS = 10_000
"""Jobs whose attempts one namespace's index keeps (the most recently reporting); their
records also go with the raw events' retention. An attempt reported again after its record
went counts as a new one."""


def event_hour(event: Event, now: float) -> int:
    """The hour an event counts in: when the client says it ran (a run reported late still
    lands in its hour), never in the future and never before the last 30 days."""
    at = event.created_at.timestamp()
    return hour_of(min(now, max(at, now - EVENT_BACKDATE_S)))
