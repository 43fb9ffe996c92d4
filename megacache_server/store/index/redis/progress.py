"""ProgressStore on Redis: a hash per job (attempt -> summary JSON), folded in under
WATCH/MULTI so batches from every replica fold into one summary, and a zset per namespace
of its jobs by when they last reported (listings, the namespace's cap, pruning)."""

from __future__ import annotations

from typing import Any

from anyio import to_thread
from redis.exceptions import WatchError

from megacache_server.store.index import progress
from megacache_server.store.index.protocols.progress import ProgressStore
from megacache_server.store.index.redis.connection import RedisConnection, text

WATCH_TRIES = 3
"""Races a many-fold write retries whole before it goes one fold at a time."""


class RedisProgress(RedisConnection, ProgressStore):
    async def add_progress_many(self, folds: list[progress.Fold], *,
                                namespace_attempts: int | None = None) -> None:
        """Every fold's summary read in one round trip, folded, and written in one MULTI
        under WATCH of every job's hash (a replica writing one of them meanwhile: again;
        after WATCH_TRIES such races, one fold at a time, so a large flush racing busy
        replicas cannot retry for ever)."""
        keys = [self.keys.progress(f.namespace, f.job) for f in folds]

        async def op() -> set[str] | None:
            async with self.r.pipeline(transaction=True) as pipe:
                for _ in range(WATCH_TRIES if len(folds) > 1 else 10**9):
                    try:
                        await pipe.watch(*set(keys))
                        new = await self._fold_all(pipe, folds, keys)
                        await pipe.execute()
                        return new
                    except WatchError:
                        continue
            return None

        if not folds:
            return
        done = await self._do(op)
        if done is None:
            for fold in folds:
                await self.add_progress_many([fold], namespace_attempts=namespace_attempts)
            return
        for namespace in sorted(done):
            await self._cap_jobs(namespace)
            if namespace_attempts is not None:
                await self._cap_attempts(namespace, namespace_attempts)

    async def _fold_all(self, pipe: Any, folds: list[progress.Fold], keys: list[str]) -> set[str]:
        """Queue the folds' writes on `pipe` (watching); the namespaces given a new attempt."""
        async with self.r.pipeline(transaction=False) as read:
            for key, f in zip(keys, folds, strict=True):
                read.hget(key, f.attempt)
                read.hkeys(key)
            got = await read.execute()
        summaries: dict[tuple[str, int], progress.AttemptProgress | None] = {}
        fields: dict[str, list[int]] = {}
        owner = {key: f.namespace for key, f in zip(keys, folds, strict=True)}
        added: dict[str, int] = {}
        new: set[str] = set()
        for i, (key, f) in enumerate(zip(keys, folds, strict=True)):
            raw, attempts = got[2 * i], fields.setdefault(key, [int(a) for a in got[2 * i + 1]])
            state = summaries.get((key, f.attempt)) or (
                progress.AttemptProgress.from_json(raw) if raw is not None else None)
            if state is None:
                if len(attempts) >= progress.MAX_ATTEMPTS and f.attempt < min(attempts):
                    continue  # the job keeps its newest progress.MAX_ATTEMPTS attempts
                attempts.append(f.attempt)
                new.add(f.namespace)
                added[f.namespace] = added.get(f.namespace, 0) + 1
            summaries[(key, f.attempt)] = progress.merge(state, f.attempt, f.model, f.records,
                                                         f.now, f.count)
        stamps = {key: self.keys.progress_at(f.namespace, f.job)
                  for key, f in zip(keys, folds, strict=True)}
        pipe.multi()
        for (key, attempt), summary in summaries.items():
            if summary is not None:
                pipe.hset(key, attempt, summary.to_json())
                pipe.hset(stamps[key], attempt, repr(summary.received_at))
        for key, attempts in fields.items():
            drop = sorted(set(attempts))[:-progress.MAX_ATTEMPTS]
            if drop:
                pipe.hdel(key, *drop)
                pipe.hdel(stamps[key], *drop)
                added[owner[key]] = added.get(owner[key], 0) - len(drop)
        for namespace, n in added.items():
            if n:
                pipe.hincrby(self.keys.progress_attempts(), namespace, n)
        for f in folds:
            pipe.zadd(self.keys.progress_jobs(f.namespace), {f.job: f.now})
            pipe.sadd(self.keys.progress_namespaces(), f.namespace)
        return new

    async def _cap_jobs(self, namespace: str) -> None:
        """Past progress.MAX_JOBS jobs, the namespace's longest silent ones go (replicas racing past
        the cap overshoot it by at most their number, until the next new attempt)."""
        jobs = self.keys.progress_jobs(namespace)
        excess = await self.r.zcard(jobs) - progress.MAX_JOBS
        if excess > 0:
            await self._forget(namespace, [text(j) or "" for j in
                                           await self.r.zrange(jobs, 0, excess - 1)])

    async def _cap_attempts(self, namespace: str, budget: int) -> None:
        """Past `budget` attempts kept (the namespace's count in `progress_attempts`), its
        longest-silent jobs go whole, as few as make up the excess (each holds at least one
        attempt, so they are among the `excess` longest silent)."""
        if not await self.r.sismember(self.keys.progress_counted(), namespace):
            await self._recount(namespace)
        held = await self.r.hget(self.keys.progress_attempts(), namespace)
        excess = int(held or 0) - budget
        if excess <= 0:
            return
        oldest = [text(j) or "" for j in
                  await self.r.zrange(self.keys.progress_jobs(namespace), 0, excess - 1)]
        async with self.r.pipeline(transaction=False) as pipe:
            for job in oldest:
                pipe.hlen(self.keys.progress(namespace, job))
            sizes = await pipe.execute()
        gone: list[str] = []
        for job, size in zip(oldest, sizes, strict=True):
            if excess <= 0:
                break
            gone.append(job)
            excess -= int(size)
        await self._forget(namespace, gone)

    async def _recount(self, namespace: str) -> None:
        """Count the namespace's attempts from its hashes, once: progress written by a server
        from before the budget was never counted (at most progress.MAX_JOBS HLENs)."""
        jobs = [text(j) or "" for j in
                await self.r.zrange(self.keys.progress_jobs(namespace), 0, -1)]
        async with self.r.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.hlen(self.keys.progress(namespace, job))
            sizes = await pipe.execute() if jobs else []
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.progress_attempts(), namespace, sum(int(n) for n in sizes))
            pipe.sadd(self.keys.progress_counted(), namespace)
            await pipe.execute()

    async def _forget(self, namespace: str, jobs: list[str]) -> None:
        """Drop `jobs` whole, and their attempts from the namespace's count."""
        if not jobs:
            return
        async with self.r.pipeline(transaction=True) as pipe:
            for job in jobs:
                pipe.hlen(self.keys.progress(namespace, job))
                pipe.delete(self.keys.progress(namespace, job), self.keys.progress_at(namespace,
                                                                                     job))
            pipe.zrem(self.keys.progress_jobs(namespace), *jobs)
            done = await pipe.execute()
        gone = sum(int(n) for n in done[0:2 * len(jobs):2])
        if gone:
            await self.r.hincrby(self.keys.progress_attempts(), namespace, -gone)

    async def job_progress(self, namespace: str, job: str) -> progress.JobProgress | None:
        async def op() -> progress.JobProgress | None:
            seen = await self.r.zscore(self.keys.progress_jobs(namespace), job)
            if seen is None:
                return None
            return _job(namespace, job, float(seen),
                        await self.r.hgetall(self.keys.progress(namespace, job)))

        return await self._do(op)

    async def recent_progress_stamps(self, *, namespace: str | None, since: float,
                                     limit: int, per_namespace: bool = False
                                     ) -> list[tuple[str, str, float]]:
        async def op() -> list[tuple[str, str, float]]:
            spaces = [namespace] if namespace is not None else sorted(
                text(n) or "" for n in await self.r.smembers(self.keys.progress_namespaces()))
            found: list[tuple[str, str, float]] = []
            for ns in spaces:
                found += [(ns, text(job) or "", float(seen)) for job, seen in
                          await self.r.zrevrangebyscore(self.keys.progress_jobs(ns), "+inf",
                                                        since, start=0, num=limit,
                                                        withscores=True)]
            found.sort(key=lambda t: (-t[2], t[0], t[1]))
            return found if per_namespace else found[:limit]

        return await self._do(op)

    async def jobs_progress(self, jobs: list[tuple[str, str, float]]) -> list[progress.JobProgress]:
        async def op() -> list[progress.JobProgress]:
            async with self.r.pipeline(transaction=False) as pipe:
                for ns, job, _ in jobs:
                    pipe.hgetall(self.keys.progress(ns, job))
                hashes = await pipe.execute()
            return await to_thread.run_sync(lambda: [  # ~70 µs an attempt: off the loop
                _job(ns, job, seen, raw)
                for (ns, job, seen), raw in zip(jobs, hashes, strict=True) if raw])

        return await self._do(op) if jobs else []

    async def attempt_stamps(self, jobs: list[tuple[str, str]]
                             ) -> dict[tuple[str, str], progress.JobStamps]:
        """Attempts from the summaries' hash, stamps from `progress_at` (an attempt written
        by a server from before the stamps has none: its job is read whole each time)."""
        async def op() -> list[Any]:
            async with self.r.pipeline(transaction=False) as pipe:
                for ns, job in jobs:
                    pipe.hkeys(self.keys.progress(ns, job))
                    pipe.hgetall(self.keys.progress_at(ns, job))
                return list(await pipe.execute())

        got = await self._do(op) if jobs else []
        found: dict[tuple[str, str], progress.JobStamps] = {}
        for i, key in enumerate(jobs):
            attempts = sorted(int(a) for a in got[2 * i])
            if not attempts:
                continue
            at = {int(k): progress.stamp_us(float(v)) for k, v in got[2 * i + 1].items()}
            others = [at.get(a) for a in attempts[:-1]]
            found[key] = progress.JobStamps(
                len(attempts), attempts[-1], at.get(attempts[-1]),
                None if None in others else sum(o for o in others if o is not None))
        return found

    async def attempts_progress(self, wanted: list[tuple[str, str, int]]
                                ) -> dict[tuple[str, str, int], progress.AttemptProgress]:
        async def op() -> list[Any]:
            async with self.r.pipeline(transaction=False) as pipe:
                for ns, job, attempt in wanted:
                    pipe.hget(self.keys.progress(ns, job), attempt)
                return list(await pipe.execute())

        raw = await self._do(op) if wanted else []
        return await to_thread.run_sync(lambda: {
            key: progress.AttemptProgress.from_json(v)
            for key, v in zip(wanted, raw, strict=True) if v is not None})

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


def _job(namespace: str, job: str, seen: float, raw: dict[Any, Any]) -> progress.JobProgress:
    attempts = sorted((progress.AttemptProgress.from_json(v) for v in raw.values()),
                      key=lambda a: a.attempt)
    return progress.JobProgress(namespace, job, seen, tuple(attempts))
