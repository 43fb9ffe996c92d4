"""ETT over time as bounded rollups, the same on every index backend (`EttRollupStore`).

A job's split changes while it runs (its last attempt trains on; a failure turns training
into lost progress, back to the last checkpoint), so the fleet's ETT per hour cannot be
added up once and for all as the cache's events are. Instead each job's part of each hour
(`Contribution`: its seconds by category, its failures by cause and what they cost, its
starts and recoveries as histogram buckets) is kept beside the rollups, and a roll
(`service.ett.roller`) replaces a job's contribution with its new one, adding the
difference to the hourly and daily rows of its (namespace, model): `row_deltas`. The
rows then hold, at any moment, the sum of the contributions of every job rolled, whatever
their history, and a trend of 30 days reads 30 daily rows per model, not 20,000 jobs.

A roll applies only if the contribution stored is still the one it read (a stale roller
never adds a difference twice). Bounded: hourly rows are kept `HOURLY_KEEP_DAYS`, daily
rows `DAILY_KEEP_DAYS`, a contribution as long as its job is kept (the events' retention),
and a namespace's rows name at most `rollups.MAX_MODELS` models (further ones count under
`rollups.OTHER_MODELS`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from megacache_client.wire.progress import CAUSES
from megacache_server.store.index.rollups import BUCKETS, DAY

CATEGORIES = ("training", "data_wait", "startup", "compile", "checkpoint_save",
              "checkpoint_restore", "lost_progress", "recovery", "idle")
"""`service.ett.CATEGORIES` (the store does not import the service)."""
HISTOGRAMS = ("tts", "ttr")
"""Time to start (per job) and time to recover (per recovery), in `rollups.BUCKETS`."""
COUNTERS = (*(f"s_{c}" for c in CATEGORIES),
            *(f"{k}_{c}" for k in ("f", "u", "r") for c in CAUSES),
            *(f"{h}_b{i:02d}" for h in HISTOGRAMS for i in range(len(BUCKETS) + 1)),
            *(f"{h}_{k}" for h in HISTOGRAMS for k in ("count", "sum")))
"""Seconds by category (`s_`), failures (`f_`), the training they threw away (`u_`) and
the recovery they cost (`r_`) by cause, the two histograms' buckets, counts and sums."""
HOURLY_KEEP_DAYS = 8
DAILY_KEEP_DAYS = 400
PERIODS = {"hour": "h", "day": "d"}

Counters = dict[str, float]
Vector = list[float]
"""A row's counters in `COUNTERS` order: how rows are read (a month's rows add up in C)."""
RowKey = tuple[str, str, int]
INDEX = {name: i for i, name in enumerate(COUNTERS)}
"""(model, period "h" or "d", the period's start)."""


@dataclass(frozen=True)
class Contribution:
    """One job's part of the rollups: its counters per hour it touched (sparse)."""

    model: str
    hours: dict[int, Counters] = field(default_factory=dict)
    lost_s: float = 0.0
    """Its lost progress and recovery in all: the "top jobs by lost time" order."""
    last_seen: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "lost_s": self.lost_s,
                           "last_seen": self.last_seen,
                           "hours": {str(h): c for h, c in sorted(self.hours.items())}},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Contribution:
        d = json.loads(raw)
        return cls(model=str(d["model"]), lost_s=float(d["lost_s"]),
                   last_seen=float(d["last_seen"]),
                   hours={int(h): {k: float(v) for k, v in c.items()}
                          for h, c in d["hours"].items()})

    @property
    def version(self) -> str:
        """What a roll compares to know the contribution is still the one it read."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Roll:
    """Replace a job's contribution `before` (None: none yet) with `after`."""

    namespace: str
    job: str
    before: Contribution | None
    after: Contribution


def row_deltas(before: Contribution | None, after: Contribution | None
               ) -> dict[RowKey, Counters]:
    """What replacing `before` with `after` adds to each hourly and daily row (negative
    where a counter went down); rows and counters that do not move are left out."""
    out: dict[RowKey, Counters] = {}
    for sign, part in ((-1.0, before), (1.0, after)):
        if part is None:
            continue
        for hour, counters in part.hours.items():
            for key in ((part.model, "h", hour), (part.model, "d", hour // DAY * DAY)):
                row = out.setdefault(key, {})
                for name, value in counters.items():
                    row[name] = row.get(name, 0.0) + sign * value
    return {key: kept for key, row in out.items()
            if (kept := {k: v for k, v in row.items() if abs(v) > 1e-9})}


def vector(counters: Counters, into: Vector | None = None) -> Vector:
    """`counters` (plus `into`) as a vector; unknown names are dropped."""
    out = list(into) if into is not None else [0.0] * len(COUNTERS)
    for name, value in counters.items():
        i = INDEX.get(name)
        if i is not None:
            out[i] += value
    return out


def encode(vec: Vector) -> str:
    """A row's counters as stored: the non-zero ones as a flat JSON list of index, value
    pairs (a row has ~15 of its 79 counters set: a month's rows decode 5x faster than
    whole vectors)."""
    return json.dumps([x for i, v in enumerate(vec) if v for x in (i, round(v, 6))],
                      separators=(",", ":"))


def decode(texts: list[str]) -> list[Vector]:
    """Rows' counters as stored (`encode`), back as vectors, in one JSON decode."""
    out = []
    zero = [0.0] * len(COUNTERS)
    for pairs in json.loads("[" + ",".join(texts) + "]"):
        vec = zero.copy()
        for k in range(0, len(pairs), 2):
            vec[pairs[k]] = pairs[k + 1]
        out.append(vec)
    return out


def add(into: Counters, more: Counters) -> Counters:
    for name, value in more.items():
        into[name] = into.get(name, 0.0) + value
    return into


def kept_since(period: str, now: float) -> float:
    """The oldest period start still kept for `period` ("h" or "d")."""
    days = HOURLY_KEEP_DAYS if period == "h" else DAILY_KEEP_DAYS
    return now - days * DAY
