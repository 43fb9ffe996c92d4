"""ETT over many jobs: per model and per namespace within a window, and checkpoint advice.
Pure, like `ett`: job splits in, figures out.

Checkpoint advice (per model): a save blocks the loop `b` seconds; failures come at `λ` per
second of running (training, lost progress and saves). Saving every `T` seconds costs the
share `b/T` of the loop in blocking and, at each failure, half an interval of training on
average: `λT/2`. Their sum is least at `T* = √(2b/λ)`; moving from the measured mean
interval `T` to `T*` returns `((b/T + λT/2) − (b/T* + λT*/2)) × 100` ETT points. How sure:
the number of failures `λ` rests on (none: no advice).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from megacache_server.service.ett.causes import add_causes, cause_rows
from megacache_server.service.ett.components import COMPONENTS
from megacache_server.service.ett.split import (
    CATEGORIES,
    JobSplit,
    ett_pct,
    report_figures,
    total,
)


def window(splits: Iterable[JobSplit], since: float, until: float) -> dict[str, Any]:
    """ETT of `splits` within [since, until]: in total, per namespace and per model (each
    job's seconds clipped to the window), with checkpoint advice per model."""
    jobs = list(splits)
    per_job = [(j, j.within(since, until)) for j in jobs]
    by_model: dict[str, list[tuple[JobSplit, dict[str, float]]]] = {}
    by_namespace: dict[str, list[dict[str, float]]] = {}
    for j, seconds in per_job:
        by_model.setdefault(j.model or "", []).append((j, seconds))
        by_namespace.setdefault(j.namespace, []).append(seconds)
    by_ns_jobs: dict[str, list[JobSplit]] = {}
    for j in jobs:
        by_ns_jobs.setdefault(j.namespace, []).append(j)
    models = []
    for model, rows in sorted(by_model.items()):
        found = [j for j, _ in rows]
        models.append({"model": model or None, "jobs": len(rows),
                       **_figures(total(s for _, s in rows)), **starts(found),
                       "failures": sum(j.totals.failures for j, _ in rows),
                       "failures_by_cause": causes(found),
                       "components": component_quantiles(found),
                       "advice": advice(found), "advice_why": no_advice_why(found)})
    return {"since": since, "until": until, "jobs": len(jobs),
            "live": sum(j.live for j in jobs),
            **_figures(total(s for _, s in per_job)), **starts(jobs),
            "failures_by_cause": causes(jobs),
            "namespaces": [{"namespace": ns, "jobs": len(rows), **_figures(total(rows)),
                            "failures_by_cause": causes(by_ns_jobs[ns])}
                           for ns, rows in sorted(by_namespace.items())],
            "models": models}


def causes(jobs: list[JobSplit]) -> list[dict[str, Any]]:
    """The jobs' failures by cause: how many, the training they threw away, the recovery
    they cost (`split.by_cause`)."""
    return cause_rows(add_causes(j.totals.by_cause for j in jobs))


def component_quantiles(jobs: list[JobSplit]) -> dict[str, dict[str, Any]]:
    """Median and p90 of each component (`ett_components`) of the jobs' starts and of
    their recoveries, over those that have it (nearest rank, as `starts`), and of the
    process groups made; components nobody spent a millisecond in are left out."""
    out: dict[str, dict[str, Any]] = {}
    for kind in ("start", "recover"):
        parts = [a.components for j in jobs for a in j.attempts
                 if a.components is not None
                 and (a.time_to_start_s if kind == "start" else a.time_to_recover_s)
                 is not None]
        if not parts:
            continue
        row = {c: _quantiles([p["seconds"][c] for p in parts]) for c in COMPONENTS
               if any(p["seconds"][c] >= 0.001 for p in parts)}
        row["process_groups"] = _quantiles([p["process_groups"] for p in parts])
        out[kind] = row
    return out


def tiles(splits: list[JobSplit], since: float, until: float, shown: int
          ) -> dict[str, Any]:
    """What the dashboard draws of ETT: the window's figures, and the `shown` jobs that
    reported last with their split within the window (a stacked bar each)."""
    jobs = []
    for j in splits[:shown]:
        seconds = j.within(since, until)
        jobs.append({"job_id": j.job, "namespace": j.namespace, "model": j.model,
                     "live": j.live, "last_seen": j.last_seen, **_figures(seconds),
                     **report_figures(seconds, j.time_to_start_s, j.recoveries()),
                     "failures": j.totals.failures,
                     "failures_by_cause": cause_rows(j.totals.by_cause),
                     "lost_s_per_failure": [round(x, 3) for x in j.lost_per_failure()],
                     "attempts": len(j.attempts), "starts": bars(j)})
    return {**window(splits, since, until), "shown": jobs}


def bars(job: JobSplit) -> list[dict[str, Any]]:
    """The job's start and each recovery, by component: a stacked bar each."""
    return [{"attempt": a.attempt, "kind": "start" if a.time_to_start_s is not None
             else "recover", "cause": job.attempts[i - 1].cause if i else None,
             **a.components} for i, a in enumerate(job.attempts)
            if a.components is not None]


def _figures(seconds: dict[str, float]) -> dict[str, Any]:
    return {"wall_s": round(sum(seconds.values()), 3), "ett_pct": ett_pct(seconds),
            "checkpoint_save_s": round(seconds["checkpoint_save"], 3),
            "unsaved_training_s": round(seconds["lost_progress"], 3),
            "seconds": {k: round(seconds[k], 3) for k in CATEGORIES}}


def starts(jobs: list[JobSplit]) -> dict[str, Any]:
    """Time to start (per job) and time to recover (per recovery) over `jobs`: median, p90
    and how many, read off the values themselves (nearest rank), never a histogram's
    buckets: one 14.8 s recovery is 14.8 s."""
    return {"time_to_start": _quantiles([t for j in jobs
                                         if (t := j.time_to_start_s) is not None]),
            "time_to_recover": _quantiles([t for j in jobs for t in j.recoveries()])}


def _quantiles(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3) if ordered else None

    return {"n": len(ordered), "p50_s": at(0.5), "p90_s": at(0.9)}


def no_advice_why(jobs: Iterable[JobSplit]) -> str | None:
    """Why `advice` has none for these jobs (None when it has some)."""
    totals = [j.totals for j in jobs]
    failures = sum(t.failures for t in totals)
    saves = sum(t.saves for t in totals)
    if failures and saves and sum(t.seconds["checkpoint_save"] for t in totals) > 0:
        return None
    if not failures and not saves:
        return "no failure and no checkpoint save seen yet"
    if not failures:
        return "no failure seen yet: nothing to weigh the saves against"
    if not saves:
        return (f"{failures} failure{'s' if failures > 1 else ''} but no checkpoint save "
                "seen: report saves (DCP, or megacache_client.checkpoint())")
    return "the saves blocked the loop for no measurable time"


def advice(jobs: Iterable[JobSplit]) -> dict[str, Any] | None:
    """The checkpoint interval that would return the most ETT for these jobs (of one model),
    with the inputs it used; None without a failure or a save to learn from."""
    totals = [j.totals for j in jobs]
    failures = sum(t.failures for t in totals)
    saves = sum(t.saves for t in totals)
    blocking = sum(t.seconds["checkpoint_save"] for t in totals)
    run = sum(t.seconds[c] for t in totals
              for c in ("training", "lost_progress", "checkpoint_save"))
    if failures == 0 or saves == 0 or blocking <= 0 or run <= 0:
        return None
    b, rate = blocking / saves, failures / run
    best = math.sqrt(2 * b / rate)
    intervals = sum(t.save_intervals for t in totals)
    current = sum(t.save_interval_s for t in totals) / intervals if intervals else None
    if current is not None and current <= 0:
        current = None

    def cost(t: float) -> float:
        return b / t + rate * t / 2

    return {"blocking_per_save_s": round(b, 3), "saves": saves, "failures": failures,
            "run_s": round(run, 3), "failures_per_hour": round(rate * 3600, 6),
            "interval_s": round(current, 3) if current is not None else None,
            "best_interval_s": round(best, 3),
            "ett_gain_pct": (round((cost(current) - cost(best)) * 100, 3)
                             if current is not None else None),
            "confidence": "low" if failures < 3 else "medium" if failures < 10 else "high"}
