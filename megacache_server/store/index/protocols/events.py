"""Events: client runs folded into rollups, and the views read from them (per-model
stats, the timeline, miss reasons, a job's attempts)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from megacache_client.wire.events import OUTCOMES, REPLAYS, Event
from megacache_client.wire.text import as_text
from megacache_server.store.index import rollups


@dataclass
class ModelStats:
    namespace: str
    model: str
    runs: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    compile_s: float = 0.0
    saved_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    tts_s: float = 0.0
    tts_n: int = 0
    jobs: dict[str, float] = field(default_factory=lambda: dict.fromkeys(rollups.JOB_COUNTERS,
                                                                         0.0))
    """Job attempts, restarts and the job histograms (`rollups.JOB_COUNTERS`)."""
    replays: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLAYS, 0))
    """Runs by `Event.replay` (full, partial, rebuilt); runs that did not say count in none."""

    def __post_init__(self) -> None:  # a name stored before the text rule: shown escaped
        self.model = as_text(self.model, 256)

    @property
    def attempts(self) -> int:
        return int(self.jobs["attempts"])

    @property
    def restarts(self) -> int:
        return int(self.jobs["restarts"])

    def buckets(self, histogram: str) -> list[float]:
        """A job histogram's bucket counts, not cumulative; the last is +Inf's."""
        return rollups.bucket_counts(self.jobs, histogram)

    def quantile(self, histogram: str, q: float) -> float | None:
        return rollups.quantile(self.buckets(histogram), q)

    @property
    def hit_rate(self) -> float:
        """Runs that started warm (exact or fallback) over all runs."""
        warm = self.outcomes["hit"] + self.outcomes["fallback"]
        return warm / self.runs if self.runs else 0.0

    @property
    def mean_tts_s(self) -> float | None:
        """Mean time from process start to the first compiled step, where clients said."""
        return self.tts_s / self.tts_n if self.tts_n else None

    def add(self, counters: dict[str, float]) -> None:
        self.runs += int(counters.get("runs", 0))
        for outcome in OUTCOMES:
            self.outcomes[outcome] += int(counters.get(outcome, 0))
        self.compile_s += counters.get("compile_s", 0.0)
        self.saved_s += counters.get("saved_s", 0.0)
        self.bytes_down += int(counters.get("bytes_down", 0))
        self.bytes_up += int(counters.get("bytes_up", 0))
        self.tts_s += counters.get("tts_s", 0.0)
        self.tts_n += int(counters.get("tts_n", 0))
        jobs = self.jobs
        for name in rollups.JOB_COUNTERS:
            jobs[name] += counters.get(name, 0.0)
        for replay in REPLAYS:
            self.replays[replay] += int(counters.get(rollups.replay_counter(replay), 0))


@dataclass(frozen=True)
class TimelineSlot:
    start: int
    runs: int
    warm: int
    saved_s: float
    tts_s: float
    tts_n: int


@dataclass(frozen=True)
class MissReason:
    model: str
    outcome: str
    reason: str
    count: int

    def __post_init__(self) -> None:  # stored by a server from before the text rule
        object.__setattr__(self, "model", as_text(self.model, 256))
        object.__setattr__(self, "reason", as_text(self.reason, 2000))


@dataclass(frozen=True)
class AttemptRecord(rollups.AttemptState):
    """One job attempt as its ranks reported it: the slowest rank's time to start (attempt
    0) or recover, that rank's outcome, the most compile seconds of any rank (what the
    index keeps of it, `rollups.AttemptState`), and which attempt it is."""

    attempt: int


@dataclass(frozen=True)
class JobView:
    namespace: str
    job_id: str
    last_seen: float
    attempts: list[AttemptRecord]  # newest attempt first


MAX_VIEW_ATTEMPTS = 20
"""Attempts of one job a job view lists (the latest)."""


class EventLog(ABC):
    """Client runs, folded into rollups as they arrive (running totals that never go down,
    hourly buckets, miss reasons), with raw events kept for a bounded time only; runs of a
    job are also folded per (job, attempt), each attempt counted once (its slowest rank)."""

    @abstractmethod
    async def add_event(self, namespace: str, event: Event) -> None:
        """Record one run: its raw event, and its counters in every rollup."""

    @abstractmethod
    async def stats(self, *, namespace: str | None, since: float | None = None
                    ) -> list[ModelStats]:
        """Per-(namespace, model) sums since `since` (hour resolution; None: all time)."""

    @abstractmethod
    async def timeline(self, *, namespace: str | None, since: float,
                       daily: bool = False) -> list[TimelineSlot]:
        """Hourly runs, warm starts, seconds saved and time to start since `since`."""

    @abstractmethod
    async def top_misses(self, *, namespace: str | None, since: float,
                         limit: int) -> list[MissReason]:
        """The most frequent reasons runs did not start warm."""

    @abstractmethod
    async def prune_events(self, *, raw_before: float, rollups_before: float) -> int:
        """Drop raw events and hourly rollups older than these times (totals stay), and
        job attempt records not reported since `raw_before` or beyond rollups.MAX_JOBS."""

    @abstractmethod
    async def recent_jobs(self, *, namespace: str | None, limit: int) -> list[JobView]:
        """The `limit` jobs that reported last, each with its latest attempts."""

    @abstractmethod
    async def job_view(self, namespace: str, job: str) -> JobView | None:
        """One job of `namespace` with its latest attempts; None if it never reported."""
