"""EttRollupStore on Redis: a hash per (namespace, period, start) of model -> its counters
(`ett_rollups.encode`: a month's read is 30 HGETALLs of a field per model; it
expires when its period is no longer kept), a string per job holding its contribution,
and zsets of the jobs by lost time and by last roll. A batch of rolls is applied in one
MULTI under WATCH of its jobs' contributions and the rows it adds to (a replica writing
one of them meanwhile: again, then one roll at a time)."""

from __future__ import annotations

import functools
import time

from redis.exceptions import WatchError

from megacache_server.store.index import rollups
from megacache_server.store.index.ett_rollups import (
    DAILY_KEEP_DAYS,
    HOURLY_KEEP_DAYS,
    Contribution,
    Counters,
    Roll,
    Vector,
    add,
    decode,
    encode,
    kept_since,
    row_deltas,
    vector,
)
from megacache_server.store.index.protocols.ett_rollups import EttRollupStore, JobKey
from megacache_server.store.index.redis.connection import RedisConnection, text

WATCH_TRIES = 3
BATCH = 200
KEEP_S = {"h": HOURLY_KEEP_DAYS * rollups.DAY, "d": DAILY_KEEP_DAYS * rollups.DAY}


class RedisEttRollups(RedisConnection, EttRollupStore):
    async def ett_contributions(self, jobs: list[JobKey]) -> dict[JobKey, Contribution]:
        async def op() -> dict[JobKey, Contribution]:
            async with self.r.pipeline(transaction=False) as pipe:
                for ns, job in jobs:
                    pipe.get(self.keys.ett_contrib(ns, job))
                raw = await pipe.execute()
            return {key: Contribution.from_json(value) for key, value in zip(jobs, raw,
                                                                             strict=True)
                    if value is not None}

        return await self._do(op) if jobs else {}

    async def roll_ett(self, rolls: list[Roll]) -> int:
        done = 0
        for i in range(0, len(rolls), BATCH):
            part = rolls[i:i + BATCH]
            applied = await self._do(functools.partial(self._roll, part, WATCH_TRIES))
            if applied is None:  # raced too often: one at a time
                for roll in part:
                    one: int | None = await self._do(functools.partial(self._roll, [roll], 10**9))
                    done += one or 0
            else:
                done += applied
        return done

    async def _roll(self, rolls: list[Roll], tries: int) -> int | None:
        """The rolls that still apply (their contributions unchanged), with every row they
        add to, read and written under WATCH: a replica writing any of them meanwhile
        makes this try again."""
        keys = [self.keys.ett_contrib(r.namespace, r.job) for r in rolls]
        now = time.time()
        async with self.r.pipeline(transaction=True) as pipe:
            for _ in range(tries):
                try:
                    await pipe.watch(*set(keys))
                    stored = [await pipe.get(key) for key in keys]
                    applied = [(roll, key) for roll, key, raw in zip(rolls, keys, stored,
                                                                     strict=True)
                               if (Contribution.from_json(raw).version if raw is not None
                                   else None) == (roll.before.version if roll.before
                                                  else None)]
                    sums: dict[tuple[str, str, int], dict[str, Counters]] = {}
                    for roll, _ in applied:
                        for (model, period, start), delta in row_deltas(roll.before,
                                                                        roll.after).items():
                            if start >= kept_since(period, now):
                                row = sums.setdefault((roll.namespace, period, start), {})
                                add(row.setdefault(model, {}), delta)
                    rows = {self.keys.ett_row(*where): where for where in sums}
                    if rows:
                        await pipe.watch(*keys, *rows)
                    old = {key: await pipe.hmget(key, list(sums[where]))
                           for key, where in rows.items()}
                    pipe.multi()
                    for key, where in rows.items():
                        models = list(sums[where])
                        pipe.hset(key, mapping={
                            m: encode(vector(sums[where][m],
                                             decode([text(raw) or "[]"])[0] if raw else None))
                            for m, raw in zip(models, old[key], strict=True)})
                        pipe.expireat(key, int(where[2] + KEEP_S[where[1]] + rollups.DAY))
                    for roll, key in applied:
                        ns = roll.namespace
                        pipe.set(key, roll.after.to_json())
                        pipe.zadd(self.keys.ett_lost(ns), {roll.job: roll.after.lost_s})
                        pipe.zadd(self.keys.ett_seen(ns), {roll.job: roll.after.last_seen})
                        pipe.sadd(self.keys.ett_models(ns), roll.after.model)
                        pipe.sadd(self.keys.ett_namespaces(), ns)
                    await pipe.execute()
                    return len(applied)
                except WatchError:
                    continue
        return None

    async def ett_models(self, namespace: str) -> set[str]:
        found = await self._do(lambda: self.r.smembers(self.keys.ett_models(namespace)))
        return {text(m) or "" for m in found}

    async def _ett_namespaces(self, namespace: str | None) -> list[str]:
        if namespace is not None:
            return [namespace]
        return sorted(text(n) or "" for n in
                      await self.r.smembers(self.keys.ett_namespaces()))

    async def ett_rows(self, *, namespace: str | None, period: str, since: int, until: int,
                       model: str | None = None) -> list[tuple[str, str, int, Vector]]:
        step = rollups.HOUR if period == "h" else rollups.DAY
        first = -(-since // step) * step

        async def op() -> list[tuple[str, str, int, Vector]]:
            wanted = [(ns, start) for ns in await self._ett_namespaces(namespace)
                      for start in range(first, until + 1, step)]
            async with self.r.pipeline(transaction=False) as pipe:
                for ns, start in wanted:
                    pipe.hgetall(self.keys.ett_row(ns, period, start))
                found = await pipe.execute()
            keys, raws = [], []
            for (ns, start), row in zip(wanted, found, strict=True):
                for field, value in row.items():
                    m = text(field) or ""
                    if model is None or m == model:
                        keys.append((ns, m, start))
                        raws.append(text(value) or "[]")
            return [(*key, vec) for key, vec in zip(keys, decode(raws), strict=True)]

        return await self._do(op)

    async def ett_top_lost(self, *, namespace: str | None, since: float, limit: int
                           ) -> list[tuple[str, str, str, float, float]]:
        async def op() -> list[tuple[str, str, str, float, float]]:
            found: list[tuple[str, str, str, float, float]] = []
            for ns in await self._ett_namespaces(namespace):
                top = await self.r.zrevrangebyscore(self.keys.ett_lost(ns), "+inf", "(0",
                                                    start=0, num=limit * 4,
                                                    withscores=True)
                jobs = [text(j) or "" for j, _ in top]
                async with self.r.pipeline(transaction=False) as pipe:
                    for job in jobs:
                        pipe.get(self.keys.ett_contrib(ns, job))
                    raw = await pipe.execute() if jobs else []
                for job, value in zip(jobs, raw, strict=True):
                    if value is None:
                        continue
                    c = Contribution.from_json(value)
                    if c.last_seen >= since:
                        found.append((ns, job, c.model, c.lost_s, c.last_seen))
            found.sort(key=lambda t: (-t[3], t[1]))
            return found[:limit]

        return await self._do(op)

    async def ett_roll_mark(self) -> float:
        found = await self._do(lambda: self.r.get(self.keys.ett_mark()))
        return float(found) if found is not None else 0.0

    async def set_ett_roll_mark(self, at: float) -> None:
        await self._do(lambda: self.r.set(self.keys.ett_mark(), repr(at)))

    async def prune_ett(self, now: float, jobs_before: float) -> int:
        """Rows expire by themselves; the contributions of jobs not rolled since
        `jobs_before` go here."""
        async def op() -> int:
            gone = 0
            for ns in await self._ett_namespaces(None):
                seen = self.keys.ett_seen(ns)
                old = [text(j) or "" for j in
                       await self.r.zrangebyscore(seen, "-inf", f"({jobs_before}")]
                if not old:
                    continue
                async with self.r.pipeline(transaction=True) as pipe:
                    pipe.delete(*(self.keys.ett_contrib(ns, j) for j in old))
                    pipe.zrem(seen, *old)
                    pipe.zrem(self.keys.ett_lost(ns), *old)
                    await pipe.execute()
                gone += len(old)
            return gone

        return await self._do(op)
