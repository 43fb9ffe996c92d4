"""What `/v1/stats` and the dashboard show, assembled from the index's rollups.

Every number comes from running totals and hourly or daily rollups, never from raw events,
so a report costs the same whatever the history. A new dashboard tile is a field added to
`dashboard()` here and drawn by the page (`api/static/dashboard.html`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields
from typing import Any

from megacache_client.wire.events import REPLAYS
from megacache_server.service.ett.split import JobSplit
from megacache_server.store.index import rollups
from megacache_server.store.index.base import EntryInfo, Index, JobView, ModelStats

JOBS_SHOWN = 10
"""Jobs the dashboard lists (those that reported last)."""


async def stats(index: Index, *, scope: str | None, since: float | None) -> dict[str, Any]:
    """Per-model and total runs, outcomes and savings of the namespace `scope` (None: all)."""
    models = await index.stats(namespace=scope, since=since)
    return {"total": _total(models), "models": [_model_row(m) for m in models]}


async def jobs(index: Index, *, scope: str | None, limit: int) -> list[dict[str, Any]]:
    """The `limit` jobs of `scope` that reported last, with their latest attempts."""
    return [_job_row(j) for j in await index.recent_jobs(namespace=scope, limit=limit)]


def job_rows(views: list[JobView], splits: list[JobSplit], limit: int
             ) -> list[dict[str, Any]]:
    """The jobs that reported last, by their events (`views`) or their progress (`splits`),
    each with its attempts as the events tell them and its ETT (None without progress)."""
    ett = {(s.namespace, s.job): s for s in splits}
    rows = [{**_job_row(v), "ett": _ett_row(ett.pop((v.namespace, v.job_id), None))}
            for v in views]
    rows += [{"namespace": s.namespace, "job_id": s.job, "last_seen": s.last_seen,
              "restarts": max((a.attempt for a in s.attempts), default=0), "attempts": [],
              "ett": _ett_row(s)} for s in ett.values()]
    rows.sort(key=lambda r: -r["last_seen"])
    return rows[:limit]


def _ett_row(split: JobSplit | None) -> dict[str, Any] | None:
    if split is None:
        return None
    row = split.row(attempts=False)
    del row["namespace"], row["job_id"], row["last_seen"]
    return row


def _job_row(job: JobView) -> dict[str, Any]:
    return {"namespace": job.namespace, "job_id": job.job_id, "last_seen": job.last_seen,
            "restarts": max((a.attempt for a in job.attempts), default=0),
            "attempts": [{"attempt": a.attempt, "model": a.model, "outcome": a.outcome,
                          "kind": "start" if a.attempt == 0 else "recover",
                          "seconds": _round(a.tts_s), "compile_s": round(a.compile_s, 3),
                          "reports": a.reports, "world_size": a.world_size,
                          "first_seen": a.first_seen, "last_seen": a.last_seen}
                         for a in job.attempts]}


async def dashboard(index: Index, *, scope: str | None, budget: int | None,
                    hours: float) -> dict[str, Any]:
    """Everything the dashboard shows for the last `hours`, for the namespace `scope`."""
    now = time.time()
    since = now - hours * 3600
    models = await index.stats(namespace=scope, since=since)
    bucket = 3600 if hours <= 72 else 86400
    timeline = await index.timeline(namespace=scope, since=since, daily=bucket == 86400)
    misses = await index.top_misses(namespace=scope, since=since, limit=10)
    largest = await index.largest_entries(namespace=scope, limit=10)
    entries, visible_bytes = await index.usage(scope)
    if scope is None:
        visible_bytes = await index.stored_bytes()
    slots: dict[int, dict[str, float]] = {}
    for slot in timeline:
        start = slot.start // bucket * bucket
        s = slots.setdefault(start, {"runs": 0, "warm": 0, "saved_s": 0.0, "tts_s": 0.0,
                                     "tts_n": 0})
        for name in ("runs", "warm", "saved_s", "tts_s", "tts_n"):
            s[name] += getattr(slot, name)
    return {
        "generated_at": now,
        "hours": hours,
        "bucket_s": bucket,
        "namespace": scope,
        "total": _total(models),
        "models": [_model_row(m) for m in models],
        "timeline": [{"start": k, "runs": v["runs"], "warm": v["warm"],
                      "saved_s": round(v["saved_s"], 3),
                      "tts_s": round(v["tts_s"] / v["tts_n"], 3) if v["tts_n"] else None}
                     for k, v in sorted(slots.items())],
        "top_misses": [asdict(m) for m in misses],
        "largest_entries": [_entry_row(e) for e in largest],
        "jobs": await jobs(index, scope=scope, limit=JOBS_SHOWN),
        # a tenant sees the bytes its entries name; the store's total and budget are the
        # operator's (auth off)
        "store": {"bytes": visible_bytes, "entries": entries,
                  "budget": budget if scope is None else None},
    }


def _model_row(m: ModelStats) -> dict[str, Any]:
    # fields read one level deep, not `asdict`: it would deep-copy the ~90 job counters of
    # every model (up to MAX_MODELS rows per report) only for them to be dropped
    row = {f.name: getattr(m, f.name) for f in fields(m) if f.name != "jobs"}
    row.update(outcomes=dict(m.outcomes), replays=dict(m.replays),
               hit_rate=round(m.hit_rate, 4), compile_s=round(m.compile_s, 3),
               saved_s=round(m.saved_s, 3), mean_tts_s=_round(m.mean_tts_s))
    row.update(_job_figures(m.jobs))
    return row


def _job_figures(jobs: dict[str, float]) -> dict[str, Any]:
    """Per job attempt (its slowest rank): time to start and to recover, median and p90,
    interpolated within the histogram buckets (rollups.BUCKETS) as Prometheus's
    histogram_quantile does; restarts; compile seconds on the critical path per attempt."""
    out: dict[str, Any] = {"attempts": int(jobs["attempts"]), "restarts": int(jobs["restarts"])}
    for h, name in (("start", "tts"), ("recover", "ttr")):
        out[f"{name}_n"] = int(jobs[f"{h}_count"])
        counts = rollups.bucket_counts(jobs, h)
        out[f"{name}_p50_s"] = _round(rollups.quantile(counts, 0.5))
        out[f"{name}_p90_s"] = _round(rollups.quantile(counts, 0.9))
    n = jobs["compile_count"]
    out["compile_per_job_s"] = round(jobs["compile_sum"] / n, 3) if n else None
    split_n = jobs["split_n"]
    out["tts_split_s"] = {p: round(jobs[f"split_{p}_s"] / split_n, 3)
                          for p in rollups.SPLIT} if split_n else None
    return out


def _round(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def _total(models: list[ModelStats]) -> dict[str, Any]:
    runs = sum(m.runs for m in models)
    warm = sum(m.outcomes["hit"] + m.outcomes["fallback"] for m in models)
    saved = sum(m.saved_s for m in models)
    tts_n = sum(m.tts_n for m in models)
    return {"runs": runs, "warm": warm, "hit_rate": round(warm / runs, 4) if runs else 0.0,
            "compile_s": round(sum(m.compile_s for m in models), 3),
            "saved_s": round(saved, 3), "saved_hours": round(saved / 3600, 4),
            "bytes_down": sum(m.bytes_down for m in models),
            "bytes_up": sum(m.bytes_up for m in models),
            "mean_tts_s": round(sum(m.tts_s for m in models) / tts_n, 3) if tts_n else None,
            "replays": {r: sum(m.replays[r] for m in models) for r in REPLAYS},
            **_job_figures({name: sum(m.jobs[name] for m in models)
                            for name in rollups.JOB_COUNTERS})}


def _entry_row(e: EntryInfo) -> dict[str, Any]:
    return {"key": e.key, "model": e.model, "namespace": e.namespace, "bytes": e.size,
            "pinned": e.pinned, "last_access": e.last_access}
