"""The fleet's ETT over time. Pure, like `ett`: a job's split in, its part of each hour out
(`contribution`); the rollups' rows in, the trend out (`trend`).

A job's part of an hour (`store.index.ett_rollups.COUNTERS`): the seconds of its split
(each category's segments clipped to the hour); each failure, by cause, in the hour its
attempt failed, with the training it threw away and the recovery it cost (the next
attempt's time to recover); its time to start in the hour of its first step, each time to
recover in the hour of the recovery's first step, as `rollups.BUCKETS` histograms. Over a
period the trend gives ETT% and the seconds by category (exact sums), the failures by
cause (exact counts and sums), and time to start and to recover as p50/p90 interpolated
within the buckets (as Prometheus's `histogram_quantile`: within a bucket's width of the
nearest-rank value the window views give).
"""

from __future__ import annotations

import math
import operator
from typing import Any

from megacache_client.wire.progress import CAUSES
from megacache_server.service.ett.split import CATEGORIES, JobSplit, Segment, ett_pct
from megacache_server.store.index import rollups
from megacache_server.store.index.ett_rollups import (
    COUNTERS,
    Contribution,
    Counters,
    Vector,
    add,
)
from megacache_server.store.index.rollups import DAY, HOUR, bucket_of

PERIOD_S = {"h": HOUR, "d": DAY}
SECONDS = [COUNTERS.index(f"s_{c}") for c in CATEGORIES]
TRAINING = COUNTERS.index("s_training")
FAILURES = [COUNTERS.index(f"f_{c}") for c in CAUSES]
BUCKET_KEYS = {h: [f"{h}_b{i:02d}" for i in range(len(rollups.BUCKETS) + 1)]
               for h in ("tts", "ttr")}


def contribution(job: JobSplit, model: str) -> Contribution:
    """The job's part of each hour it touched (see the module), under `model` (the one its
    rows count under: its own, or `rollups.OTHER_MODELS` past the namespace's cap)."""
    hours: dict[int, Counters] = {}
    _seconds(job.segments, hours)
    for i, a in enumerate(job.attempts):
        if a.failed:
            cause = a.cause or "unknown"
            nxt = job.attempts[i + 1] if i + 1 < len(job.attempts) else None
            _add(hours, a.end, {f"f_{cause}": 1.0, f"u_{cause}": a.seconds["lost_progress"],
                                f"r_{cause}": (nxt.time_to_recover_s or 0.0) if nxt else 0.0})
        if a.time_to_start_s is not None:
            _observe(hours, a.start + a.time_to_start_s, "tts", a.time_to_start_s)
        if a.time_to_recover_s is not None:
            _observe(hours, a.start + a.time_to_recover_s, "ttr", a.time_to_recover_s)
    lost = job.seconds["lost_progress"] + job.seconds["recovery"]
    return Contribution(model=model, lost_s=round(lost, 3), last_seen=job.last_seen,
                        hours={h: {k: round(v, 6) for k, v in c.items() if v}
                               for h, c in hours.items()})


def _seconds(segments: list[Segment], hours: dict[int, Counters]) -> None:
    for s, e, c in segments:
        at = s
        while at < e:
            hour = int(at // HOUR * HOUR)
            upto = min(e, hour + HOUR)
            row = hours.setdefault(hour, {})
            row[f"s_{c}"] = row.get(f"s_{c}", 0.0) + (upto - at)
            at = upto


def _add(hours: dict[int, Counters], at: float, counters: Counters) -> None:
    add(hours.setdefault(int(at // HOUR * HOUR), {}), counters)


def _observe(hours: dict[int, Counters], at: float, histogram: str, seconds: float) -> None:
    _add(hours, at, {f"{histogram}_b{bucket_of(seconds):02d}": 1.0,
                     f"{histogram}_count": 1.0, f"{histogram}_sum": seconds})


def trend(rows: list[tuple[str, str, int, Vector]], period: str, since: int, until: int,
          top_lost: list[tuple[str, str, str, float, float]]) -> dict[str, Any]:
    """The trend of `rows` ((namespace, model, start, counters) of `period` "h" or "d"):
    per period over everything, per namespace and per model in all (with each model's ETT%
    and failures per period), and the jobs that lost the most. Counters are added as
    vectors (`COUNTERS` order, in C): a month of 50 models' days is ~10 ms."""
    step = PERIOD_S[period]
    first = since // step * step
    by_start: dict[int, list[float]] = {}
    by_ns: dict[str, list[float]] = {}
    by_cell: dict[tuple[str, int], list[float]] = {}
    spaces = {ns for ns, *_ in rows}
    several = len(spaces) > 1  # one namespace (a tenant's view): its sum is the total
    for ns, model, start, vec in rows:
        _into(by_start, start, vec)
        if several:
            _into(by_ns, ns, vec)
        _into(by_cell, (model, start), vec)
    by_model: dict[str, list[float]] = {}
    cells: dict[str, list[tuple[int, list[float]]]] = {}
    for (model, start), vec in sorted(by_cell.items()):
        _into(by_model, model, vec)
        cells.setdefault(model, []).append((start, vec))
    everything = [math.fsum(column) for column in zip(*by_start.values(), strict=True)] \
        if by_start else [0.0] * len(COUNTERS)
    if not several:
        by_ns = {ns: everything for ns in spaces}
    return {
        "period": "hour" if period == "h" else "day", "since": first, "until": until,
        **figures(_named(everything)),
        "series": [{"start": start, **figures(_named(by_start.get(start)))}
                   for start in range(first, until + 1, step)],
        "namespaces": [{"namespace": ns, **figures(_named(v))} for ns, v in sorted(by_ns.items())],
        "models": [{"model": m, **figures(_named(v)),
                    "series": [{"start": start, "ett_pct": _ett_pct(cell),
                                "failures": int(round(sum(cell[i] for i in FAILURES)))}
                               for start, cell in cells[m]]}
                   for m, v in sorted(by_model.items())],
        "top_lost": [{"namespace": ns, "job_id": job, "model": model or None,
                      "lost_s": lost, "last_seen": seen}
                     for ns, job, model, lost, seen in top_lost],
    }


def _into(table: dict[Any, list[float]], key: Any, vec: list[float]) -> None:
    """`vec` added to `table[key]` (element-wise, in C)."""
    found = table.get(key)
    table[key] = vec if found is None else list(map(operator.add, found, vec))


def _named(vec: list[float] | None) -> Counters:
    return dict(zip(COUNTERS, vec, strict=True)) if vec is not None else {}


def _ett_pct(vec: list[float]) -> float | None:
    wall = sum(vec[i] for i in SECONDS)
    return round(min(100.0, 100.0 * vec[TRAINING] / wall), 3) if wall > 0 else None


def figures(c: Counters) -> dict[str, Any]:
    """One period's (or one sum's) figures out of its counters."""
    seconds = {k: round(c.get(f"s_{k}", 0.0), 3) for k in CATEGORIES}
    return {"wall_s": round(sum(seconds.values()), 3), "ett_pct": ett_pct(seconds),
            "seconds": seconds, "failures": _failures(c),
            "failures_by_cause": [{"cause": k, "failures": int(round(c[f"f_{k}"])),
                                   "unsaved_training_s": round(c.get(f"u_{k}", 0.0), 3),
                                   "recovery_s": round(c.get(f"r_{k}", 0.0), 3)}
                                  for k in CAUSES if c.get(f"f_{k}", 0.0) >= 0.5],
            "time_to_start": _histogram(c, "tts"), "time_to_recover": _histogram(c, "ttr")}


def _failures(c: Counters) -> int:
    return int(round(sum(c.get(f"f_{k}", 0.0) for k in CAUSES)))


def _histogram(c: Counters, name: str) -> dict[str, Any]:
    counts = [max(c.get(key, 0.0), 0.0) for key in BUCKET_KEYS[name]]

    def q(at: float) -> float | None:
        found = rollups.quantile(counts, at)
        return round(found, 3) if found is not None else None

    return {"n": int(round(sum(counts))), "p50_s": q(0.5), "p90_s": q(0.9)}
