"""ETT as Prometheus families, per namespace, from the splits of the jobs the server keeps
(`progress.MAX_ETT_JOBS` that reported last): seconds by category, ETT%, and histograms of
time to start (per job), time to recover (per recovery), checkpoint blocking per save
(checkpoint save time) and of the training lost per failure (unsaved training time): the
figures of the job's ETT, `/v1/stats`, the dashboard and `megacache jobs`, by the same
definitions (`ett.report_figures`).

The seconds are each kept job's whole split at scrape time: they grow as jobs run, and a
failure moves seconds from training to lost_progress; a job dropped from the kept set
takes its seconds with it (a counter reset to Prometheus's `rate()`)."""

from __future__ import annotations

from megacache_server.service.ett import CATEGORIES, JobSplit, ett_pct, total
from megacache_server.store.index.progress import SAVE_BUCKETS
from megacache_server.store.index.rollups import BUCKETS

LOST_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
                14400.0)


def ett_families(jobs: list[JobSplit]) -> bytes:
    """The families in Prometheus text format."""
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
    return ("\n".join(lines) + "\n").encode()


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
