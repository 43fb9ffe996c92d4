"""Keeping the ETT rollups up to date: every `MEGACACHE_ETT_ROLL_S` (60 s), the jobs that
reported since the last roll are split again (through a `SplitCache` of its own: a
heartbeating job costs its last attempt) and their parts of each hour
(`ett_trend.contribution`) replace those stored, the difference going into the hourly and
daily rows (`store.index.ett_rollups`). One process rolls at a time across workers and
replicas (the `ett-roll` lock); a roll that dies is redone from the same mark by the next.
So the trend lags the jobs by at most one interval (plus the heartbeats' own flush).

The roll also prunes: contributions of jobs gone from the index (the events' retention)
and rows older than their period is kept, once an hour.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from megacache_server.service.ett import trend as ett_trend
from megacache_server.service.ett.intake import compile_seconds
from megacache_server.service.ett.split_cache import SplitCache
from megacache_server.store.index import rollups
from megacache_server.store.index.base import Index, JobView
from megacache_server.store.index.ett_rollups import Roll

log = logging.getLogger("megacache.server")

LOCK = "ett-roll"
MARGIN_S = 120.0
"""Jobs seen this long before the last roll began are looked at again (another worker's
heartbeats reach the index within its flush, replicas' clocks differ a little)."""
ROLL_JOBS = 200_000
PRUNE_S = 3600.0
KEPT_ATTEMPTS = 20_000
"""Attempts whose splits the roller keeps between rolls (a heartbeating job's next roll
reads its last attempt only); fewer than the views' cache: the roller reads changed jobs."""


class Roller:
    """Rolls the jobs that reported into the ETT rollups (see the module)."""

    def __init__(self, index: Index, interval_s: float, retention_days: float) -> None:
        self.index = index
        self.interval_s = interval_s
        self.retention_s = retention_days * 86400
        self.cache = SplitCache(index, max_attempts=KEPT_ATTEMPTS)
        self._pruned = 0.0

    async def run_forever(self) -> None:
        while True:
            try:
                await self.roll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # storage down: the next roll catches up from the mark
                log.warning("ETT roll failed: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def roll_once(self) -> int:
        """One roll (if this process gets the lock): how many jobs' parts changed."""
        if not await self.index.acquire_lock(LOCK, ttl_s=max(60.0, 4 * self.interval_s)):
            return 0
        try:
            began = time.time()
            mark = await self.index.ett_roll_mark()
            stamps = await self.index.recent_progress_stamps(
                namespace=None, since=max(0.0, mark - MARGIN_S), limit=ROLL_JOBS)
            changed = await self._roll(stamps) if stamps else 0
            await self.index.set_ett_roll_mark(began)
            if began - self._pruned >= PRUNE_S:
                self._pruned = began
                await self.index.prune_ett(began, began - self.retention_s)
            return changed
        finally:
            with contextlib.suppress(Exception):
                await self.index.release_lock(LOCK)

    async def _roll(self, stamps: list[tuple[str, str, float]]) -> int:
        views = await self.index.recent_jobs(namespace=None, limit=500)
        by_job: dict[tuple[str, str], JobView] = {(v.namespace, v.job_id): v for v in views}
        splits = await self.cache.splits(stamps, lambda ns, job: compile_seconds(by_job.get(
            (ns, job))))
        stored = await self.index.ett_contributions([(s.namespace, s.job) for s in splits])
        models: dict[str, set[str]] = {}
        rolls = []
        for split in splits:
            key = (split.namespace, split.job)
            if split.namespace not in models:
                models[split.namespace] = await self.index.ett_models(split.namespace)
            known = models[split.namespace]
            model = split.model or ""
            if model not in known:
                if len(known) >= rollups.MAX_MODELS:
                    model = rollups.OTHER_MODELS
                known.add(model)
            before = stored.get(key)
            after = ett_trend.contribution(split, model)
            if before is None or before.to_json() != after.to_json():
                rolls.append(Roll(split.namespace, split.job, before, after))
        return await self.index.roll_ett(rolls)
