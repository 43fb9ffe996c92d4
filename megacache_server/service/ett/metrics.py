"""ETT as Prometheus families, per namespace, from the splits of the jobs the server keeps
(each namespace's own `progress.MAX_ETT_JOBS` that reported last, never the latest across
all: #58): seconds by category, ETT%, and histograms of time to start (per job), time
to recover (per recovery), checkpoint blocking per save (checkpoint save time) and of
the training lost per failure (unsaved training time): the figures of the job's ETT,
`/v1/stats`, the dashboard and `megacache jobs`, by the same definitions
(`ett.report_figures`).

The seconds are each kept job's whole split at scrape time: they grow as jobs run, and a
failure moves seconds from training to lost_progress; a job dropped from the kept set
takes its seconds with it (a counter reset to Prometheus's `rate()`).

Why and where (#60): failures by cause (`wire.progress.CAUSES`, a bounded label: every
cause has a series in every namespace, so `increase()` sees the first one), the training
they threw away and the recovery they cost; the seconds of each component of the starts
and recoveries (`ett_components`) and the process groups they made; and time to start per
model as a summary (p50, p90 over the kept jobs' starts) for the models `/metrics` shows
(the metric budget's, `metric_budget`; the rest under `other`)."""

from __future__ import annotations

import math

from megacache_client.wire.progress import CAUSES
from megacache_server.service.ett.causes import add_causes
from megacache_server.service.ett.components import COMPONENTS
from megacache_server.service.ett.split import CATEGORIES, JobSplit, ett_pct, total
from megacache_server.service.observability.metric_budget import OTHER
from megacache_server.store.index.progress import SAVE_BUCKETS
from megacache_server.store.index.rollups import BUCKETS

LOST_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
                14400.0)


def ett_families(jobs: list[JobSplit],
                 models: set[tuple[str, str]] | None = None) -> bytes:
    """The families in Prometheus text format; `models`: the (namespace, model) pairs with
    series of their own (None: every model)."""
    by_ns: dict[str, list[JobSplit]] = {}
    for j in jobs:
        by_ns.setdefault(j.namespace, []).append(j)
    seconds = {ns: total(j.seconds for j in js) for ns, js in sorted(by_ns.items())}
    lines = ["# HELP megacache_job_seconds_total Wall seconds of the kept jobs, by ETT "
             "category (docs/ett.md; checkpoint_save: checkpoint save time, lost_progress: "
             "unsaved training time)", "# TYPE megacache_job_seconds_total counter"]
    for ns, sums in seconds.items():
        lines += [f'megacache_job_seconds_total{{namespace="{_esc(ns)}",category="{c}"}} '
                  f"{sums[c]!r}" for c in CATEGORIES]
    lines += ["# HELP megacache_job_ett_percent Training over wall time of the kept jobs",
              "# TYPE megacache_job_ett_percent gauge"]
    lines += [f'megacache_job_ett_percent{{namespace="{_esc(ns)}"}} {pct!r}'
              for ns, sums in seconds.items() if (pct := ett_pct(sums)) is not None]
    lines += _histogram("megacache_job_time_to_start_seconds",
                        "Time to start of each kept job: allocation (or process start) to "
                        "its first optimizer step", BUCKETS,
                        {ns: _observed([t for j in js if (t := j.time_to_start_s) is not None],
                                       BUCKETS) for ns, js in sorted(by_ns.items())})
    lines += _histogram("megacache_job_time_to_recover_seconds",
                        "Time to recover of each recovery of the kept jobs: the failure to "
                        "the next attempt's first optimizer step", BUCKETS,
                        {ns: _observed([t for j in js for t in j.recoveries()], BUCKETS)
                         for ns, js in sorted(by_ns.items())})
    lines += _histogram("megacache_checkpoint_blocking_seconds",
                        "Seconds the training loop waited on each checkpoint save",
                        SAVE_BUCKETS, {ns: _saves(js) for ns, js in sorted(by_ns.items())})
    lines += _histogram("megacache_job_lost_seconds",
                        "Training seconds lost at each failure (since the last durable "
                        "checkpoint)", LOST_BUCKETS,
                        {ns: _lost(js) for ns, js in sorted(by_ns.items())})
    lines += _causes(by_ns) + _components(by_ns) + _model_starts(jobs, models)
    return ("\n".join(lines) + "\n").encode()


CAUSE_FAMILIES = (
    ("megacache_job_failures_total", "Failures of the kept jobs' attempts, by cause", 0),
    ("megacache_job_failure_unsaved_seconds_total",
     "Training the failures threw away (unsaved training time), by cause", 1),
    ("megacache_job_failure_recovery_seconds_total",
     "Time to recover from the failures, by cause", 2),
)


def _causes(by_ns: dict[str, list[JobSplit]]) -> list[str]:
    lines: list[str] = []
    sums = {ns: add_causes(j.totals.by_cause for j in js) for ns, js in sorted(by_ns.items())}
    for name, doc, i in CAUSE_FAMILIES:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
        for ns, found in sums.items():
            lines += [f'{name}{{namespace="{_esc(ns)}",cause="{c}"}} '
                      f"{float(found.get(c, (0, 0.0, 0.0))[i])!r}" for c in CAUSES]
    return lines


def _components(by_ns: dict[str, list[JobSplit]]) -> list[str]:
    """Seconds per component of the kept jobs' starts and recoveries, and the process
    groups they made."""
    name, groups = ("megacache_job_start_component_seconds_total",
                    "megacache_job_process_groups_total")
    lines = [f"# HELP {name} Seconds of the kept jobs' starts (kind=start) and recoveries "
             "(kind=recover) by component (docs/ett.md)", f"# TYPE {name} counter",
             f"# HELP {groups} Process groups the kept jobs made on their way to the first "
             "step", f"# TYPE {groups} counter"]
    for ns, js in sorted(by_ns.items()):
        sums = {k: dict.fromkeys(COMPONENTS, 0.0) for k in ("start", "recover")}
        made = dict.fromkeys(sums, 0)
        for a in (a for j in js for a in j.attempts):
            if a.components is None:
                continue
            kind = "start" if a.time_to_start_s is not None else "recover"
            for c, v in a.components["seconds"].items():
                sums[kind][c] += v
            made[kind] += a.components["process_groups"]
        for kind, by in sums.items():
            lines += [f'{name}{{namespace="{_esc(ns)}",kind="{kind}",component="{c}"}} '
                      f"{v!r}" for c, v in by.items()]
            lines.append(f'{groups}{{namespace="{_esc(ns)}",kind="{kind}"}} {made[kind]}')
    return lines


def _model_starts(jobs: list[JobSplit], models: set[tuple[str, str]] | None) -> list[str]:
    """Time to start per model: p50 and p90 over the kept jobs' starts (nearest rank)."""
    name = "megacache_model_time_to_start_seconds"
    by: dict[tuple[str, str], list[float]] = {}
    for j in jobs:
        if (t := j.time_to_start_s) is None:
            continue
        key = (j.namespace, j.model or "")
        if models is not None and key not in models:
            key = (j.namespace, OTHER)
        by.setdefault(key, []).append(t)
    lines = [f"# HELP {name} Time to start of the kept jobs per model: allocation (or "
             "process start) to the first optimizer step", f"# TYPE {name} summary"]
    for (ns, model), values in sorted(by.items()):
        ordered = sorted(values)
        labels = f'namespace="{_esc(ns)}",model="{_esc(model)}"'
        for q in (0.5, 0.9):
            v = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
            lines.append(f'{name}{{{labels},quantile="{q}"}} {v!r}')
        lines += [f"{name}_sum{{{labels}}} {sum(ordered)!r}",
                  f"{name}_count{{{labels}}} {len(ordered)}"]
    return lines


def _saves(jobs: list[JobSplit]) -> tuple[list[int], float]:
    counts = [0] * (len(SAVE_BUCKETS) + 1)
    blocking = 0.0
    for a in (a for j in jobs for a in j.attempts):
        for i, n in enumerate(a.save_buckets):
            counts[i] += n
        blocking += a.saves_blocking_s
    return counts, blocking


def _lost(jobs: list[JobSplit]) -> tuple[list[int], float]:
    return _observed([x for j in jobs for x in j.lost_per_failure()], LOST_BUCKETS)


def _observed(values: list[float], bounds: tuple[float, ...]) -> tuple[list[int], float]:
    """`values` as a histogram's (non-cumulative) bucket counts, +Inf last, and their sum."""
    counts = [0] * (len(bounds) + 1)
    for x in values:
        counts[next((i for i, b in enumerate(bounds) if x <= b), len(bounds))] += 1
    return counts, sum(values)


def _histogram(name: str, doc: str, bounds: tuple[float, ...],
               series: dict[str, tuple[list[int], float]]) -> list[str]:
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
    les = [repr(float(b)) for b in bounds] + ["+Inf"]
    for ns, (counts, sum_) in series.items():
        key = f'namespace="{_esc(ns)}"'
        cumulative = 0
        for le, n in zip(les, counts, strict=True):
            cumulative += n
            lines.append(f'{name}_bucket{{{key},le="{le}"}} {cumulative}')
        lines += [f"{name}_count{{{key}}} {cumulative}", f"{name}_sum{{{key}}} {sum_!r}"]
    return lines


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
