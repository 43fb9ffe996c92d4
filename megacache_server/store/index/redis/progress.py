"""ProgressStore on Redis: a hash per job (attempt -> summary JSON), folded in under
WATCH/MULTI so batches from every replica fold into one summary, and a zset per namespace
of its jobs by when they last reported (listings, the namespace's cap, pruning)."""

from __future__ import annotations

from typing import Any

from anyio import to_thread
from redis.exceptions import WatchError

from megacache_client.wire.progress import ProgressRecord
from megacache_server.store.index.base import ProgressStore
from megacache_server.store.index.progress import (
    MAX_ATTEMPTS,
    MAX_JOBS,
    AttemptProgress,
    JobProgress,
    merge,
)
from megacache_server.store.index.redis.connection import RedisConnection, text


class RedisProgress(RedisConnection, ProgressStore):
    async def add_progress(self, namespace: str, job: str, attempt: int, model: str | None,
                           records: list[ProgressRecord], now: float) -> None:
        key = self.keys.progress(namespace, job)

        async def op() -> None:
            async with self.r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        raw = await pipe.hget(key, attempt)
                        attempts = [int(a) for a in await pipe.hkeys(key)] if raw is None \
                            else []
                        if len(attempts) >= MAX_ATTEMPTS and attempt < min(attempts):
                            return  # the job keeps its newest MAX_ATTEMPTS attempts
                        state = AttemptProgress.from_json(raw) if raw is not None else None
                        summary = merge(state, attempt, model, records, now)
                        drop = sorted(attempts + [attempt])[:-MAX_ATTEMPTS]
                        pipe.multi()
                        pipe.hset(key, attempt, summary.to_json())
                        if drop:
                            pipe.hdel(key, *drop)
                        pipe.zadd(self.keys.progress_jobs(namespace), {job: now})
                        pipe.sadd(self.keys.progress_namespaces(), namespace)
                        await pipe.execute()
                        break
                    except WatchError:
                        continue
            if state is None:
                await self._cap_jobs(namespace)

        await self._do(op)

    async def _cap_jobs(self, namespace: str) -> None:
        """Past MAX_JOBS jobs, the namespace's longest silent ones go (replicas racing past
        the cap overshoot it by at most their number, until the next new attempt)."""
        jobs = self.keys.progress_jobs(namespace)
        excess = await self.r.zcard(jobs) - MAX_JOBS
        if excess > 0:
            await self._forget(namespace, [text(j) or "" for j in
                                           await self.r.zrange(jobs, 0, excess - 1)])

    async def _forget(self, namespace: str, jobs: list[str]) -> None:
        if not jobs:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.delete(self.keys.progress(namespace, job))
            pipe.zrem(self.keys.progress_jobs(namespace), *jobs)
            await pipe.execute()

    async def job_progress(self, namespace: str, job: str) -> JobProgress | None:
        async def op() -> JobProgress | None:
            seen = await self.r.zscore(self.keys.progress_jobs(namespace), job)
            if seen is None:
                return None
            return _job(namespace, job, float(seen),
                        await self.r.hgetall(self.keys.progress(namespace, job)))

        return await self._do(op)

    async def recent_progress(self, *, namespace: str | None, since: float,
                              limit: int) -> list[JobProgress]:
        async def op() -> list[JobProgress]:
            spaces = [namespace] if namespace is not None else sorted(
                text(n) or "" for n in await self.r.smembers(self.keys.progress_namespaces()))
            found: list[tuple[float, str, str]] = []
            for ns in spaces:
                found += [(seen, ns, text(job) or "") for job, seen in
                          await self.r.zrevrangebyscore(self.keys.progress_jobs(ns), "+inf",
                                                        since, start=0, num=limit,
                                                        withscores=True)]
            found.sort(key=lambda t: (-t[0], t[1], t[2]))
            found = found[:limit]
            async with self.r.pipeline(transaction=False) as pipe:
                for _, ns, job in found:
                    pipe.hgetall(self.keys.progress(ns, job))
                hashes = await pipe.execute()
            return await to_thread.run_sync(lambda: [  # ~70 µs an attempt: off the loop
                _job(ns, job, seen, raw)
                for (seen, ns, job), raw in zip(found, hashes, strict=True)])

        return await self._do(op)

    async def prune_progress(self, before: float) -> int:
        async def op() -> int:
            gone = 0
            for ns in [text(n) or "" for n in
                       await self.r.smembers(self.keys.progress_namespaces())]:
                old = [text(j) or "" for j in await self.r.zrangebyscore(
                    self.keys.progress_jobs(ns), "-inf", f"({before!r}")]
                await self._forget(ns, old)
                gone += len(old)
            return gone

        return await self._do(op)


def _job(namespace: str, job: str, seen: float, raw: dict[Any, Any]) -> JobProgress:
    attempts = sorted((AttemptProgress.from_json(v) for v in raw.values()),
                      key=lambda a: a.attempt)
    return JobProgress(namespace, job, seen, tuple(attempts))
