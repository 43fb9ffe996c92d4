"""EventLog on Redis: raw events in a capped list; running totals, hourly and daily rollups
and miss-reason counts in hashes and sorted sets that expire with the retention
(`rollups.py` says how events fold into them). Each period carries a generation, so a
process adds up only the periods that changed since it last read them (`period_sums.py`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from anyio import to_thread
from redis.exceptions import WatchError

from megacache_client.wire.events import Event
from megacache_server.store.index import rollups
from megacache_server.store.index.period_sums import Period, PeriodSums, Sums, add_up
from megacache_server.store.index.protocols import events
from megacache_server.store.index.redis.connection import RedisConnection, text

MAX_RAW_EVENTS = 10_000  # per namespace
ROLLUP_TTL_S = 400 * 24 * 3600
JOB_RECORD_TTL_S = 30 * 24 * 3600
"""A job attempt record unreported this long expires even if no server prunes it."""


class RedisEvents(RedisConnection, events.EventLog):
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
        counters = rollups.event_counters(event)
        miss = rollups.counts_miss(event)

        async def op() -> None:
            await self._daily_since()  # before the first daily write
            model, members = await self._admitted(namespace, event, hour, day, miss)
            async with self.r.pipeline(transaction=True) as pipe:
                for _ in range(100):  # another rank's report of the same attempt: again
                    try:
                        await self._add(pipe, namespace, event, model, members, counters,
                                        hour, miss)
                        return
                    except WatchError:
                        await pipe.reset()
                raise ConnectionError("job attempt record kept changing under 100 tries")

        await self._do(op)

    async def _add(self, pipe: Any, namespace: str, event: Event, model: str,
                   members: tuple[str, str], counters: dict[str, float], hour: int,
                   miss: bool) -> None:
        """One event in one transaction; a job attempt's record is read under WATCH and
        written with the rollups, so ranks reporting at once move its counts once each."""
        now = time.time()
        own = counters
        moved: tuple[rollups.AttemptState, dict[str, float]] | None = None
        state: rollups.AttemptState | None = None
        record = ""
        if event.job_id is None:
            _, deltas = rollups.attempt_update(None, event, model, hour, now)
            own = rollups.merged(counters, deltas)
        else:
            record = self.keys.attempt(namespace, event.job_id, event.attempt or 0)
            await pipe.watch(record)
            state, deltas = rollups.attempt_update(
                _state(await pipe.hgetall(record)), event, model, hour, now)
            if (state.model, state.hour) == (model, hour):
                own = rollups.merged(counters, deltas)
            elif deltas:
                moved = (state, deltas)
        pipe.multi()
        pipe.lpush(self.keys.events(namespace), event.to_json())
        pipe.ltrim(self.keys.events(namespace), 0, MAX_RAW_EVENTS - 1)
        pipe.sadd(self.keys.namespaces(), namespace)
        pipe.sadd(self.keys.models(namespace), model)
        self._count(pipe, namespace, model, hour, own)
        if moved is not None:
            self._count(pipe, namespace, moved[0].model, moved[0].hour, moved[1])
        if miss:
            for daily, period, member in ((False, hour, members[0]),
                                          (True, hour // rollups.DAY * rollups.DAY,
                                           members[1])):
                key = self.keys.period("misses", namespace, period, daily=daily)
                pipe.zincrby(key, 1, member)
                pipe.expire(key, ROLLUP_TTL_S)
        if state is not None and event.job_id is not None:
            pipe.hset(record, mapping=_fields(state))
            pipe.expire(record, JOB_RECORD_TTL_S)
            pipe.zadd(self.keys.jobs(namespace), {event.job_id: state.last_seen})
            attempts = self.keys.job_attempts(namespace, event.job_id)
            pipe.zadd(attempts, {str(event.attempt or 0): event.attempt or 0})
            pipe.expire(attempts, JOB_RECORD_TTL_S)
        await pipe.execute()
        if event.job_id is not None and await self.r.zcard(self.keys.jobs(namespace)) \
                > rollups.MAX_JOBS:
            await self._drop_jobs(namespace, [text(j) or "" for j, _ in await self.r.zpopmin(
                self.keys.jobs(namespace),
                await self.r.zcard(self.keys.jobs(namespace)) - rollups.MAX_JOBS)])

    def _count(self, pipe: Any, namespace: str, model: str, hour: int,
               counters: dict[str, float]) -> None:
        """Add `counters` to the model's total, its hour's and day's rollups and the
        all-model hourly sums, and bump those periods' generations."""
        sums = {c: v for c, v in counters.items() if v}
        fields = {f"{model}\t{c}": v for c, v in sums.items()}
        for field, value in fields.items():
            pipe.hincrbyfloat(self.keys.total(namespace), field, value)
        for daily, period in ((False, hour), (True, hour // rollups.DAY * rollups.DAY)):
            for kind, values in (("rollup", fields), ("hourly", sums)):
                key = self.keys.period(kind, namespace, period, daily=daily)
                for field, value in values.items():
                    pipe.hincrbyfloat(key, field, value)
                pipe.expire(key, ROLLUP_TTL_S)
            generation = self.keys.period("gen", namespace, period, daily=daily)
            pipe.incr(generation)
            pipe.expire(generation, ROLLUP_TTL_S)

    async def _drop_jobs(self, namespace: str, jobs: list[str]) -> None:
        """Forget these jobs' attempt records (their counts stay in the rollups)."""
        for job in jobs:
            attempts = self.keys.job_attempts(namespace, job)
            numbers = [int(a) for a in await self.r.zrange(attempts, 0, -1)]
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.jobs(namespace), job)
                pipe.delete(attempts, *(self.keys.attempt(namespace, job, n) for n in numbers))
                await pipe.execute()

    async def recent_jobs(self, *, namespace: str | None, limit: int) -> list[events.JobView]:
        async def op() -> list[events.JobView]:
            found: list[tuple[float, str, str]] = []
            for ns in await self._namespaces(namespace):
                found += [(seen, ns, text(job) or "") for job, seen in await self.r.zrevrange(
                    self.keys.jobs(ns), 0, limit - 1, withscores=True)]
            found.sort(key=lambda t: (-t[0], t[2]))
            return [await self._view(ns, job, seen) for seen, ns, job in found[:limit]]

        return await self._do(op)

    async def job_view(self, namespace: str, job: str) -> events.JobView | None:
        async def op() -> events.JobView | None:
            seen = await self.r.zscore(self.keys.jobs(namespace), job)
            return await self._view(namespace, job, float(seen)) if seen is not None else None

        return await self._do(op)

    async def _view(self, ns: str, job: str, seen: float) -> events.JobView:
        numbers = [int(a) for a in await self.r.zrevrange(
            self.keys.job_attempts(ns, job), 0, events.MAX_VIEW_ATTEMPTS - 1)]
        records = await self._hashes([self.keys.attempt(ns, job, n) for n in numbers])
        attempts = [events.AttemptRecord(**dataclasses.asdict(st), attempt=n)
                    for n, raw in zip(numbers, records, strict=True)
                    if (st := _state(raw)) is not None]
        return events.JobView(ns, job, seen, attempts)

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
                    ) -> list[events.ModelStats]:
        async def op() -> list[events.ModelStats]:
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
                       daily: bool = False) -> list[events.TimelineSlot]:
        async def op() -> list[events.TimelineSlot]:
            rows: list[tuple[int, dict[bytes, bytes]]] = []
            days_from = await self._daily_since()
            for ns in await self._namespaces(namespace):
                periods = self._periods("hourly", ns, since, days_from=days_from, daily=daily)
                hashes = await self._hashes([key for _, key, _, _ in periods])
                rows += [(start, data) for (start, *_), data in zip(periods, hashes, strict=True)]
            return await to_thread.run_sync(_timeline, rows)

        return await self._do(op)

    async def top_misses(self, *, namespace: str | None, since: float,
                         limit: int) -> list[events.MissReason]:
        async def op() -> list[events.MissReason]:
            rows = [await self._summed("misses", ns, since, self._zset_sums)
                    for ns in await self._namespaces(namespace)]
            return await to_thread.run_sync(_top_misses, rows, limit)

        return await self._do(op)

    async def prune_events(self, *, raw_before: float, rollups_before: float) -> int:
        # raw events are a capped list and rollups expire on their own; job records go
        # with the raw events' retention
        async def op() -> int:
            for ns in await self._namespaces(None):
                old = await self.r.zrangebyscore(self.keys.jobs(ns), "-inf", f"({raw_before}")
                await self._drop_jobs(ns, [text(j) or "" for j in old])
            return 0

        return await self._do(op)


_STATE_FIELDS = ("model", "hour", "outcome", "tts_s", "compile_s", "reports", "world_size",
                 "first_seen", "last_seen")


def _fields(state: rollups.AttemptState) -> dict[str, str]:
    return {name: "" if getattr(state, name) is None else str(getattr(state, name))
            for name in _STATE_FIELDS}


def _state(raw: dict[bytes, bytes]) -> rollups.AttemptState | None:
    """A job attempt record as `_fields` wrote it, or None if there is none."""
    if not raw:
        return None
    v = {text(k) or "": text(x) or "" for k, x in raw.items()}
    return rollups.AttemptState(
        model=v["model"], hour=int(v["hour"]), outcome=v["outcome"],
        tts_s=float(v["tts_s"]) if v["tts_s"] else None, compile_s=float(v["compile_s"]),
        reports=int(v["reports"]), world_size=int(v["world_size"]) if v["world_size"] else None,
        first_seen=float(v["first_seen"]), last_seen=float(v["last_seen"]))


# The sums below run in a worker thread: at 200 models and a week of hourly rollups they
# are tens of thousands of fields, milliseconds of Python the serving loop must not wait on.

def _decoded(pairs: Iterable[tuple[bytes, Any]]) -> Sums:
    return {text(name) or "": float(value) for name, value in pairs}


def _model_stats(rows: list[tuple[str, Sums]]) -> list[events.ModelStats]:
    """Per-(namespace, model) sums of `{model}\t{counter}` rollup fields, most runs first."""
    by_model: dict[tuple[str, str], dict[str, float]] = {}
    for ns, fields in rows:
        for name, value in fields.items():
            model, _, counter = name.rpartition("\t")
            sums = by_model.setdefault((ns, model), {})
            sums[counter] = sums.get(counter, 0.0) + value
    out = []
    for (ns, model), sums in by_model.items():
        s = events.ModelStats(ns, model)
        s.add(sums)
        out.append(s)
    return sorted(out, key=lambda s: (-s.runs, s.namespace, s.model))


def _timeline(rows: list[tuple[int, dict[bytes, bytes]]]) -> list[events.TimelineSlot]:
    """Per-period sums of the `hourly` hashes of every namespace, periods with runs only."""
    slots: dict[int, dict[str, float]] = {}
    for hour, data in rows:
        slot = slots.setdefault(hour, {})
        for field, value in data.items():
            counter = text(field) or ""
            slot[counter] = slot.get(counter, 0.0) + float(value)
    return [events.TimelineSlot(h, int(s.get("runs", 0)),
                                int(s.get("hit", 0) + s.get("fallback", 0)),
                                s.get("saved_s", 0.0), s.get("tts_s", 0.0), int(s.get("tts_n", 0)))
            for h, s in sorted(slots.items()) if s.get("runs")]


def _top_misses(rows: list[Sums], limit: int) -> list[events.MissReason]:
    """The `limit` most frequent [model, outcome, reason] members over the miss zsets."""
    top = sorted(add_up(rows).items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    out = []
    for name, n in top:
        model, outcome, reason = json.loads(name)
        out.append(events.MissReason(model, outcome, reason, int(n)))
    return out
