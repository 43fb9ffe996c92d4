"""Job progress in (`POST /v1/jobs/{job}/progress`), Effective Training Time out.

A batch is recorded in the caller's namespace (a job id names a job within a namespace: the
same id in another namespace is another job, never visible from here), once it passes the
wire schema (`wire.progress`: finite, in-range numbers, at most MAX_RECORDS records) and the
server's clock: a record more than MAX_SKEW_S ahead of it, or more than MAX_AGE_S behind,
is refused with the whole batch (422, nothing stored). Batches are rate-limited per token
(`MEGACACHE_PROGRESS_RATE`), and what the index keeps of them is bounded however many come
(`store.index.progress`).
"""

from __future__ import annotations

import re
import time
from typing import Any

from anyio import to_thread

from megacache_client.wire.events import JOB_ID_PATTERN
from megacache_client.wire.progress import MAX_AGE_S, MAX_SKEW_S, ProgressBatch
from megacache_server.errors import NotFound, Unprocessable
from megacache_server.service.ett import report as ett_report
from megacache_server.service.ett import split as ett
from megacache_server.service.ett import trend as ett_trend
from megacache_server.service.ett.beats import Beats
from megacache_server.service.ett.split_cache import SplitCache
from megacache_server.service.limits.quotas import Quotas
from megacache_server.service.security.auth import Principal
from megacache_server.store.index.base import Index, JobView
from megacache_server.store.index.ett_rollups import HOURLY_KEEP_DAYS, PERIODS
from megacache_server.store.index.progress import JobProgress

MAX_ETT_JOBS = 1000
"""Jobs an ETT report over a window reads (those that reported last)."""
TOP_LOST = 10
"""Jobs the trend lists by lost time (lost progress and recovery)."""


class ProgressIntake:
    """The intake of jobs' progress (`POST /v1/jobs/{job}/progress`): recording it, and
    splitting jobs' time from it for the ETT views."""

    def __init__(self, index: Index, quotas: Quotas, beats: Beats | None = None) -> None:
        self.index = index
        self.quotas = quotas
        self.beats = beats or Beats(index, 0, 1)
        """Heartbeat-only batches go through it (`service.ett.beats`)."""
        self.cache = SplitCache(index, max_bytes=int(quotas.settings.split_cache_bytes))
        """Jobs' splits as last read, for the views over many jobs."""

    async def add_progress(self, principal: Principal, job: str, body: bytes) -> int:
        """Record a batch for `job` in the caller's namespace; how many records it held."""
        _check_job(job)
        await self.quotas.admit_progress(principal)
        batch = Unprocessable.parsed(ProgressBatch, body, "progress", "invalid_progress")
        now = time.time()
        for i, record in enumerate(batch.records):
            for name in ("at", "allocation_start"):
                _check_clock(getattr(record, name), now, f"records[{i}].{name}")
        await self.beats.add(principal.home, job, batch.attempt, batch.model,
                             list(batch.records), now)
        return len(batch.records)

    async def job_ett(self, principal: Principal, job: str, *,
                      since_s: float | None = None) -> dict[str, Any]:
        """A job's split, per attempt and in total, with checkpoint advice from its own
        attempts, and with `since_s` its split within the last `since_s` seconds
        (`window`); 404 for a job the caller's namespace never reported."""
        _check_job(job)
        await self.beats.flush_job(principal.home, job)  # what this process was sent
        found = await self.index.job_progress(principal.home, job)
        if found is None:
            raise NotFound(f"no progress reported for job {job!r}", code="job_not_found")
        view = await self.index.job_view(principal.home, job)
        # a job of many attempts is milliseconds of Python: split in a worker, never on the
        # event loop every other tenant's lookups wait on (#58)
        return await to_thread.run_sync(_job_row, found, view, since_s)

    async def splits(self, principal: Principal, *, since: float,
                     limit: int = MAX_ETT_JOBS,
                     views: list[JobView] | None = None) -> list[ett.JobSplit]:
        """The splits of the caller's jobs that reported since `since`, the latest first;
        compile seconds from `views` (the events' job attempts) where given; the operator's
        (every namespace) are each namespace's latest `limit`, never the latest `limit`
        across all (one tenant's flood would erase the others' series). Read through
        `SplitCache`: a refresh costs the attempts that changed since the last one, and a
        namespace's reads go one at a time."""
        scope = principal.namespace
        await self.beats.flush()  # what this process was sent; other processes' within a flush
        async with self.cache.lane(scope):
            stamps = await self.index.recent_progress_stamps(namespace=scope, since=since,
                                                             limit=limit, per_namespace=True)
            if views is None:
                views = await self.index.recent_jobs(namespace=scope, limit=min(limit, 500))
            by_job = {(v.namespace, v.job_id): v for v in views}
            return await self.cache.splits(
                stamps, lambda ns, job: compile_seconds(by_job.get((ns, job))))

    async def trend(self, principal: Principal, *, days: float, period: str,
                    model: str | None = None, top: int = TOP_LOST) -> dict[str, Any]:
        """The caller's ETT per hour or day (`period`) over the last `days`, from the
        rollups (`ett_trend`): one read of the rows, whatever the jobs' number, and the
        `top` jobs that lost the most."""
        if period not in PERIODS:
            raise Unprocessable(f"period is one of {', '.join(PERIODS)}", code="invalid_period")
        code = PERIODS[period]
        if code == "h" and days > HOURLY_KEEP_DAYS:
            raise Unprocessable(f"hourly rows are kept {HOURLY_KEEP_DAYS} days: ask for "
                                f"days <= {HOURLY_KEEP_DAYS}, or period=day",
                                code="invalid_period")
        now = time.time()
        since = int(now - days * 86400)
        async with self.cache.lane(principal.namespace):
            rows = await self.index.ett_rows(namespace=principal.namespace, period=code,
                                             since=since, until=int(now), model=model)
            top_lost = await self.index.ett_top_lost(namespace=principal.namespace,
                                                     since=since, limit=top)
        if model is not None:
            top_lost = [t for t in top_lost if t[2] == model]
        return await to_thread.run_sync(ett_trend.trend, rows, code, since, int(now),
                                        top_lost)

    async def report(self, principal: Principal, *, since: float | None) -> dict[str, Any]:
        """ETT of the caller's jobs within [since, now] (since None: as far as kept)."""
        now = time.time()
        splits = await self.splits(principal, since=since or 0.0)
        start = since if since is not None else min((s.attempts[0].start for s in splits
                                                     if s.attempts), default=now)
        found = await to_thread.run_sync(ett_report.window, splits, start, now)
        del found["since"], found["until"]  # the same answer until a job reports again
        return found


def _job_row(found: JobProgress, view: JobView | None, since_s: float | None
             ) -> dict[str, Any]:
    """GET /v1/jobs/{job}/ett's answer: the job's split with its advice, timeline, what the
    cache did for each attempt and, with `since_s`, the split of that window."""
    now = time.time()
    done = ett.split(found, compile_s=compile_seconds(view), now=now)
    row = {**done.row(), "advice": ett_report.advice([done]),
           "advice_why": ett_report.no_advice_why([done]),
           "timeline": [[round(a, 3), round(b, 3), c] for a, b, c in done.segments]}
    events = {a.attempt: a for a in view.attempts} if view is not None else {}
    for attempt in row["attempts"]:  # what the cache did for it, where ranks reported
        a = events.get(attempt["attempt"])
        attempt["cache"] = None if a is None else {
            "outcome": a.outcome, "compile_s": a.compile_s, "tts_s": a.tts_s,
            "ranks": a.reports}
    if since_s is not None:
        seconds = ett.clip(done.segments, now - since_s, now)
        row["window"] = {"since": now - since_s, "until": now,
                         "wall_s": round(sum(seconds.values()), 3),
                         "ett_pct": ett.ett_pct(seconds),
                         "seconds": {k: round(v, 3) for k, v in seconds.items()}}
    return row


def compile_seconds(view: JobView | None) -> dict[int, float]:
    """Each attempt's compile seconds, as the cache's events tell them (its slowest
    rank's)."""
    return {a.attempt: a.compile_s for a in view.attempts} if view is not None else {}


def _check_job(job: str) -> None:
    if not re.fullmatch(JOB_ID_PATTERN, job):
        raise Unprocessable("a job id is 1-128 of letters, digits, '.', '_', '-', starting "
                            "with a letter or digit", code="invalid_job")


def _check_clock(at: float | None, now: float, where: str) -> None:
    if at is None:
        return
    if at > now + MAX_SKEW_S:
        raise Unprocessable(
            f"{where} is {at - now:.0f} s ahead of the server's clock (at most {MAX_SKEW_S:g} "
            "s): is the trainer's clock right?", code="invalid_progress",
            errors=[{"loc": where.split("."), "msg": "in the future", "type": "clock"}])
    if at < now - MAX_AGE_S:
        raise Unprocessable(
            f"{where} is {(now - at) / 86400:.1f} days old (at most {MAX_AGE_S / 86400:g} "
            "days)", code="invalid_progress",
            errors=[{"loc": where.split("."), "msg": "too old", "type": "clock"}])
