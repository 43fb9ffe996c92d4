"""EventLog on Redis: raw events in a capped list; running totals, hourly and daily rollups
and miss-reason counts in hashes and sorted sets that expire with the retention
(`rollups.py` says how events fold into them). Each period carries a generation, so a
process adds up only the periods that changed since it last read them (`period_sums.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from anyio import to_thread

from megacache_client.events import Event
from megacache_server.store.index import rollups
from megacache_server.store.index.base import EventLog, MissReason, ModelStats, TimelineSlot
from megacache_server.store.index.period_sums import Period, PeriodSums, Sums, add_up
from megacache_server.store.index.redis.connection import RedisConnection, text

MAX_RAW_EVENTS = 10_000  # per namespace
ROLLUP_TTL_S = 400 * 24 * 3600


class RedisEvents(RedisConnection, EventLog):
    def __init__(self, url: str, prefix: str = "megacache:") -> None:
        super().__init__(url, prefix)
        self._sums = PeriodSums()
        self._days_from: float | None = None

    async def open(self) -> None:
        await super().open()
        self._days_from = None

    async def _daily_since(self) -> float:
        """When this store began writing daily rollups (set once, by the first server that
        writes them): days before it are summed from the hourly rollups instead."""
        if self._days_from is None:
            await self.r.set(self.keys.daily_from(), time.time(), nx=True)
            self._days_from = float(await self.r.get(self.keys.daily_from()))
        return self._days_from

    async def add_event(self, namespace: str, event: Event) -> None:
        hour = rollups.event_hour(event, time.time())
        day = hour // rollups.DAY * rollups.DAY
        sums = {c: v for c, v in rollups.event_counters(event).items() if v}
        periods = [(kind, period, daily) for daily, period in ((False, hour), (True, day))
                   for kind in ("rollup", "hourly", "misses")]
        miss = event.outcome not in ("hit", "fallback")

        async def op() -> None:
            await self._daily_since()  # before the first daily write
            model, members = await self._admitted(namespace, event, hour, day, miss)
            counters = {f"{model}\t{c}": v for c, v in sums.items()}
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.lpush(self.keys.events(namespace), event.to_json())
                pipe.ltrim(self.keys.events(namespace), 0, MAX_RAW_EVENTS - 1)
                pipe.sadd(self.keys.namespaces(), namespace)
                pipe.sadd(self.keys.models(namespace), model)
                for field, value in counters.items():
                    pipe.hincrbyfloat(self.keys.total(namespace), field, value)
                for kind, period, daily in periods:  # per model, all models, misses; hour, day
                    key = self.keys.period(kind, namespace, period, daily=daily)
                    if kind == "rollup":
                        for field, value in counters.items():
                            pipe.hincrbyfloat(key, field, value)
                    elif kind == "hourly":
                        for field, value in sums.items():
                            pipe.hincrbyfloat(key, field, value)
                    elif not miss:
                        continue
                    else:
                        pipe.zincrby(key, 1, members[1 if daily else 0])
                    pipe.expire(key, ROLLUP_TTL_S)
                for daily, period in ((False, hour), (True, day)):
                    generation = self.keys.period("gen", namespace, period, daily=daily)
                    pipe.incr(generation)
                    pipe.expire(generation, ROLLUP_TTL_S)
                await pipe.execute()

        await self._do(op)

    async def _admitted(self, namespace: str, event: Event, hour: int, day: int,
                        miss: bool) -> tuple[str, tuple[str, str]]:
        """The model name the event counts under (OTHER_MODELS once the namespace has
        MAX_MODELS) and its miss members for the hour's and the day's zsets (OTHER_REASONS
        once that zset holds MAX_REASONS), read in one round trip. Replicas racing past a
        bound overshoot it by at most their number."""
        zsets = (self.keys.period("misses", namespace, hour),
                 self.keys.period("misses", namespace, day, daily=True))
        member = json.dumps([event.model, event.outcome, event.reason[:200]])
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.sismember(self.keys.models(namespace), event.model)
            pipe.scard(self.keys.models(namespace))
            for zset in zsets if miss else ():
                pipe.zscore(zset, member)
                pipe.zcard(zset)
            known, n_models, *seen = await pipe.execute()
        model = event.model if known or n_models < rollups.MAX_MODELS else rollups.OTHER_MODELS
        if not miss:
            return model, ("", "")
        hour_member, day_member = (
            json.dumps([model, event.outcome, event.reason[:200] if score is not None
                        or size < rollups.MAX_REASONS else rollups.OTHER_REASONS])
            for score, size in (seen[0:2], seen[2:4]))
        return model, (hour_member, day_member)

    async def _namespaces(self, namespace: str | None) -> list[str]:
        if namespace is not None:
            return [namespace]
        return sorted(text(n) or "" for n in await self.r.smembers(self.keys.namespaces()))

    async def _hashes(self, keys: list[str]) -> list[dict[bytes, bytes]]:
        async with self.r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            return list(await pipe.execute())

    async def _hash_sums(self, keys: list[str]) -> list[Sums]:
        rows = await self._hashes(keys)
        return await to_thread.run_sync(lambda: [_decoded(row.items()) for row in rows])

    async def _zset_sums(self, keys: list[str]) -> list[Sums]:
        async with self.r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zrange(key, 0, -1, withscores=True)
            rows = await pipe.execute()
        return await to_thread.run_sync(lambda: [_decoded(row) for row in rows])

    def _periods(self, kind: str, namespace: str, since: float, *, days_from: float,
                 daily: bool = True) -> list[tuple[int, str, str, bool]]:
        """(period start, key, generation key, settled) of the `kind` rollups that add up
        to the time since `since`: whole days from the daily keys, the rest from the hourly
        ones. A period is settled once its time is over."""
        now = time.time()
        w = rollups.window(max(since, now - ROLLUP_TTL_S), now, days=daily, days_from=days_from)
        return [(h, self.keys.period(kind, namespace, h), self.keys.period("gen", namespace, h),
                 h + rollups.HOUR <= now) for h in w.hours] + \
            [(d, self.keys.period(kind, namespace, d, daily=True),
              self.keys.period("gen", namespace, d, daily=True), d + rollups.DAY <= now)
             for d in w.days]

    async def _summed(self, kind: str, namespace: str, since: float,
                      fetch: Callable[[list[str]], Awaitable[list[Sums]]]) -> Sums:
        """The `kind` rollups since `since`, summed field by field, from what this process
        already decoded wherever the period's generation says it is unchanged."""
        periods = self._periods(kind, namespace, since, days_from=await self._daily_since())
        if not periods:
            return {}
        generations = await self.r.mget([gen for _, _, gen, _ in periods])
        return await self._sums.total(
            [Period(key, None if g is None else int(g), settled)
             for (_, key, _, settled), g in zip(periods, generations, strict=True)], fetch)

    async def stats(self, *, namespace: str | None, since: float | None = None
                    ) -> list[ModelStats]:
        async def op() -> list[ModelStats]:
            rows: list[tuple[str, Sums]] = []
            for ns in await self._namespaces(namespace):
                if since is None:
                    [sums] = await self._hash_sums([self.keys.total(ns)])
                else:
                    sums = await self._summed("rollup", ns, since, self._hash_sums)
                rows.append((ns, sums))
            return await to_thread.run_sync(_model_stats, rows)

        return await self._do(op)

    async def timeline(self, *, namespace: str | None, since: float,
                       daily: bool = False) -> list[TimelineSlot]:
        async def op() -> list[TimelineSlot]:
            rows: list[tuple[int, dict[bytes, bytes]]] = []
            days_from = await self._daily_since()
            for ns in await self._namespaces(namespace):
                periods = self._periods("hourly", ns, since, days_from=days_from, daily=daily)
                hashes = await self._hashes([key for _, key, _, _ in periods])
                rows += [(start, data) for (start, *_), data in zip(periods, hashes, strict=True)]
            return await to_thread.run_sync(_timeline, rows)

        return await self._do(op)

    async def top_misses(self, *, namespace: str | None, since: float,
                         limit: int) -> list[MissReason]:
        async def op() -> list[MissReason]:
            rows = [await self._summed("misses", ns, since, self._zset_sums)
                    for ns in await self._namespaces(namespace)]
            return await to_thread.run_sync(_top_misses, rows, limit)

        return await self._do(op)

    async def prune_events(self, *, raw_before: float, rollups_before: float) -> int:
        return 0  # raw events are a capped list and rollups expire on their own


# The sums below run in a worker thread: at 200 models and a week of hourly rollups they
# are tens of thousands of fields, milliseconds of Python the serving loop must not wait on.

def _decoded(pairs: Iterable[tuple[bytes, Any]]) -> Sums:
    return {text(name) or "": float(value) for name, value in pairs}


def _model_stats(rows: list[tuple[str, Sums]]) -> list[ModelStats]:
    """Per-(namespace, model) sums of `{model}\t{counter}` rollup fields, most runs first."""
    by_model: dict[tuple[str, str], dict[str, float]] = {}
    for ns, fields in rows:
        for name, value in fields.items():
            model, _, counter = name.rpartition("\t")
            sums = by_model.setdefault((ns, model), {})
            sums[counter] = sums.get(counter, 0.0) + value
    out = []
    for (ns, model), sums in by_model.items():
        s = ModelStats(ns, model)
        s.add(sums)
        out.append(s)
    return sorted(out, key=lambda s: (-s.runs, s.namespace, s.model))


def _timeline(rows: list[tuple[int, dict[bytes, bytes]]]) -> list[TimelineSlot]:
    """Per-period sums of the `hourly` hashes of every namespace, periods with runs only."""
    slots: dict[int, dict[str, float]] = {}
    for hour, data in rows:
        slot = slots.setdefault(hour, {})
        for field, value in data.items():
            counter = text(field) or ""
            slot[counter] = slot.get(counter, 0.0) + float(value)
    return [TimelineSlot(h, int(s.get("runs", 0)), int(s.get("hit", 0) + s.get("fallback", 0)),
                         s.get("saved_s", 0.0), s.get("tts_s", 0.0), int(s.get("tts_n", 0)))
            for h, s in sorted(slots.items()) if s.get("runs")]


def _top_misses(rows: list[Sums], limit: int) -> list[MissReason]:
    """The `limit` most frequent [model, outcome, reason] members over the miss zsets."""
    top = sorted(add_up(rows).items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    out = []
    for name, n in top:
        model, outcome, reason = json.loads(name)
        out.append(MissReason(model, outcome, reason, int(n)))
    return out
