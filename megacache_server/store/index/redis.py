"""Index in Redis: shared by many stateless server replicas.

Keys (all under a prefix, default `megacache:`):
  entry:{key}            hash   manifest, etag, namespace, model, env, hw, size, digests,
                                times, pinned
  refs:{digest}          set    entry keys naming the blob (garbage collection)
  by_model:{model}       zset   entry keys by created_at (fallback lookup)
  by_envhw:{env}:{hw}    zset   entry keys by created_at (publish-side lookup)
  entries / ns:{ns}      zset   every entry key (of a namespace) by created_at
  lru / lru:{ns}         zset   entry keys by last access (eviction, quotas)
  sizes / sizes:{ns}     zset   entry keys by stored bytes (largest entries)
  usage                  hash   {ns}:entries, {ns}:bytes and *:entries, *:bytes
  blobs                  hash   digest -> size;  blob_touched  zset digest -> last touch
  unref                  set    blobs that may have no reference left: every blob recorded or
                                left by an entry that went, until GC finds it named again
                                (`unref_ready`: while set, the set covers every blob)
  owned:{ns}             set    digests a namespace uploaded; blob_owners:{digest} the reverse
  stored_bytes           int    sum of recorded blob sizes (the store budget)
  events:{ns}            list   recent raw events (capped)
  total:{ns}             hash   "{model}\\t{counter}" -> running total (never goes down)
  rollup:{ns}:{hour}     hash   the same, per hour (expires with the retention)
  hourly:{ns}:{hour}     hash   "{counter}" -> the hour's sum over every model (the timeline
                                reads 11 fields an hour, not 11 per model)
  misses:{ns}:{hour}     zset   [model, outcome, reason] -> count
  gen:{ns}:{hour}        int    events counted into that hour's rollups: a process keeps
                                decoded periods until their generation moves (period_sums)
  (rollup, hourly, misses and gen also exist as `{kind}_day:{ns}:{day}`, per UTC day)
  namespaces             set    namespaces that reported events
  models:{ns}            set    model names its rollups count (at most base.MAX_MODELS)

Conditional writes use WATCH/MULTI on the entry hash, so check-then-write is atomic across
replicas, the same contract the SQLite index keeps with BEGIN IMMEDIATE.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import redis.asyncio as aioredis
from anyio import to_thread
from redis.exceptions import RedisError, WatchError

from megacache_client.events import Event
from megacache_server.errors import ServiceUnavailable
from megacache_server.store.index import base
from megacache_server.store.index.base import (
    BlobRecord,
    EntryInfo,
    Index,
    MissReason,
    ModelStats,
    NewEntry,
    Precondition,
    StoredEntry,
    TimelineSlot,
    TokenRecord,
)
from megacache_server.store.index.period_sums import Period, PeriodSums, Sums, add_up

T = TypeVar("T")
MAX_RAW_EVENTS = 10_000  # per namespace
ROLLUP_TTL_S = 400 * 24 * 3600
SCAN = 500
SCRIPT_BATCH = 200
"""Entries or blobs per server-side script: ~15 commands each, a few ms of Redis time, so
a lookup arriving meanwhile waits little."""
UNREF_RESEED_S = 86400
"""How long `unref` is trusted before a GC seeds it from every blob again: a blob can miss
it only through a crash between two round trips or an older replica deleting entries, and
then waits at most this long to be collected."""

SCRIPTS = {
    # ARGV: prefix, entry keys. Each entry that exists and is not pinned goes with every
    # secondary key `put` wrote (the same keys `_unindex` removes); returns how many went.
    # A hash without a model is what a lookup's touch leaves of an entry deleted under it.
    "delete_unpinned": """
local p, n = ARGV[1], 0
for i = 2, #ARGV do
  local key = ARGV[i]
  local ekey = p .. 'entry:' .. key
  local f = redis.call('HMGET', ekey, 'namespace', 'model', 'env', 'hw', 'size', 'digests',
                       'pinned')
  if not f[2] then
    redis.call('DEL', ekey)
    redis.call('ZREM', p .. 'lru', key)
  elseif f[7] ~= '1' then
    local ns, size = f[1] or 'default', tonumber(f[5] or '0')
    redis.call('DEL', ekey)
    redis.call('ZREM', p .. 'by_model:' .. f[2], key)
    redis.call('ZREM', p .. 'by_envhw:' .. (f[3] or '') .. ':' .. (f[4] or ''), key)
    for _, z in ipairs({'entries', 'ns:' .. ns, 'lru', 'lru:' .. ns, 'sizes', 'sizes:' .. ns}) do
      redis.call('ZREM', p .. z, key)
    end
    redis.call('HINCRBY', p .. 'usage', ns .. ':entries', -1)
    redis.call('HINCRBY', p .. 'usage', ns .. ':bytes', -size)
    redis.call('HINCRBY', p .. 'usage', '*:entries', -1)
    redis.call('HINCRBY', p .. 'usage', '*:bytes', -size)
    for d in string.gmatch(f[6] or '', '[^,]+') do
      redis.call('SREM', p .. 'refs:' .. d, key)
      redis.call('SADD', p .. 'unref', d)
    end
    n = n + 1
  end
end
return n
""",
    # ARGV: prefix, zset key, first rank, last rank (newest first), namespace, env, hw ('' =
    # any). Returns the number of zset members read, then [key, field values...] of each entry
    # there that exists and matches every filter (fields in LISTED_FIELDS' order).
    "listed": """
local p, ns, env, hw, out = ARGV[1], ARGV[5], ARGV[6], ARGV[7], {}
local keys = redis.call('ZREVRANGE', ARGV[2], ARGV[3], ARGV[4])
out[1] = #keys
for _, key in ipairs(keys) do
  local f = redis.call('HMGET', p .. 'entry:' .. key, 'model', 'namespace', 'env', 'hw',
                       'digests', 'size', 'created_at', 'updated_at', 'last_access', 'pinned',
                       'manifest', 'etag')
  if f[1] and (ns == '' or (f[2] or 'default') == ns) and (env == '' or f[3] == env)
      and (hw == '' or f[4] == hw) then
    out[#out + 1] = key
    for i = 1, #f do out[#out + 1] = f[i] or '' end
  end
end
return out
""",
    # ARGV: prefix, entry keys. Each entry's `digests` field ('' when it names none), or
    # false (nil in the reply) where the hash is gone or is only a touch's remnant.
    "entry_digests": """
local p, out = ARGV[1], {}
for i = 2, #ARGV do
  local f = redis.call('HMGET', p .. 'entry:' .. ARGV[i], 'model', 'digests')
  if f[1] then out[i - 1] = f[2] or '' else out[i - 1] = false end
end
return out
""",
    # ARGV: prefix, digests. Drops each blob's record, size total, touch time and owners.
    "forget_blobs": """
local p = ARGV[1]
for i = 2, #ARGV do
  local d = ARGV[i]
  local size = redis.call('HGET', p .. 'blobs', d)
  if size and redis.call('HDEL', p .. 'blobs', d) == 1 then
    redis.call('DECRBY', p .. 'stored_bytes', tonumber(size))
  end
  for _, ns in ipairs(redis.call('SMEMBERS', p .. 'blob_owners:' .. d)) do
    redis.call('SREM', p .. 'owned:' .. ns, d)
  end
  redis.call('DEL', p .. 'blob_owners:' .. d)
  redis.call('ZREM', p .. 'blob_touched', d)
  redis.call('SREM', p .. 'unref', d)
end
return #ARGV - 1
""",
    # ARGV: prefix, candidate digests (from `unref`). Returns [digest, size, touched, ...] of
    # those no entry names; drops from `unref` the ones named again or no longer recorded.
    # Check and drop are one atomic step: an entry deleted meanwhile re-adds its blobs after.
    "unreferenced": """
local p, out = ARGV[1], {}
for i = 2, #ARGV do
  local d = ARGV[i]
  local size = redis.call('HGET', p .. 'blobs', d)
  if not size or redis.call('SCARD', p .. 'refs:' .. d) > 0 then
    redis.call('SREM', p .. 'unref', d)
  else
    out[#out + 1] = d
    out[#out + 1] = size
    out[#out + 1] = redis.call('ZSCORE', p .. 'blob_touched', d) or '0'
  end
end
return out
""",
}
"""Batch writes as Redis scripts: each runs atomically on the server, one round trip for a
batch. The Redis index therefore needs one Redis (a primary, with replicas if wanted), not a
Redis Cluster: a script's keys are computed inside it."""


class RedisIndex(Index):
    name = "redis"

    def __init__(self, url: str, prefix: str = "megacache:") -> None:
        self.url = url
        self.p = prefix
        self._r: aioredis.Redis | None = None
        self._owner = uuid.uuid4().hex
        self._scripts: dict[str, Any] = {}
        self._sums = PeriodSums()

    async def open(self) -> None:
        self._r = aioredis.from_url(self.url, socket_timeout=5, socket_connect_timeout=3,
                                    health_check_interval=15)
        self._days_from: float | None = None

    async def _daily_since(self) -> float:
        """When this store began writing daily rollups (set once, by the first server that
        writes them): days before it are summed from the hourly rollups instead."""
        if self._days_from is None:
            await self.r.set(self.k("daily_from"), time.time(), nx=True)
            self._days_from = float(await self.r.get(self.k("daily_from")))
        return self._days_from

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None
            self._scripts = {}

    @property
    def r(self) -> Any:  # redis' own annotations are too loose to check calls against
        if self._r is None:
            raise ServiceUnavailable("index is not open", code="index_unavailable")
        return self._r

    def k(self, *parts: str | int | None) -> str:
        return self.p + ":".join("" if p is None else str(p) for p in parts)

    @asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        try:
            yield
        except RedisError as exc:
            raise ServiceUnavailable(f"redis index unavailable: {exc}",
                                     code="index_unavailable") from exc

    async def _do(self, fn: Callable[[], Awaitable[T]]) -> T:
        async with self._guard():
            return await fn()

    # -- entries ------------------------------------------------------------------------
    async def get(self, key: str, *, touch: bool = True) -> StoredEntry | None:
        async def op() -> StoredEntry | None:
            data = await self.r.hgetall(self.k("entry", key))
            if not data:
                return None
            entry = _stored(key, data)
            if touch:
                now = time.time()
                async with self.r.pipeline(transaction=False) as pipe:
                    pipe.hset(self.k("entry", key), "last_access", now)
                    pipe.zadd(self.k("lru"), {key: now})
                    pipe.zadd(self.k("lru", entry.namespace), {key: now})
                    await pipe.execute()
            return entry

        return await self._do(op)

    async def put(self, entry: NewEntry, condition: Precondition) -> tuple[StoredEntry, bool]:
        etag = base.entry_etag(entry.manifest_json)
        key = entry.key
        ekey = self.k("entry", key)

        async def op() -> tuple[StoredEntry, bool]:
            async with self.r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(ekey)
                        old = await pipe.hgetall(ekey)
                        current = _str(old.get(b"etag")) if old else None
                        base.check_precondition(condition, current)
                        now = time.time()
                        pinned = _str(old.get(b"pinned")) == "1" if old else False
                        pipe.multi()
                        if old:
                            self._unindex(pipe, key, old)
                        self._write_entry(pipe, entry, etag, now, pinned)
                        await pipe.execute()
                        stored = StoredEntry(key, entry.namespace, entry.model,
                                             entry.digests, entry.size, entry.created_at,
                                             now, now, pinned, entry.manifest_json, etag)
                        return stored, current is None
                    except WatchError:
                        continue

        return await self._do(op)

    def _write_entry(self, pipe: Any, entry: NewEntry, etag: str, now: float,
                     pinned: bool) -> None:
        """Queue an entry's hash and every secondary key (the ones `_unindex` removes)."""
        key, ns = entry.key, entry.namespace
        pipe.hset(self.k("entry", key), mapping={
            "manifest": entry.manifest_json, "etag": etag,
            "namespace": ns, "model": entry.model,
            "env": entry.env_digest, "hw": entry.hw_digest, "size": entry.size,
            "digests": ",".join(entry.digests),
            "created_at": entry.created_at, "updated_at": now,
            "last_access": now, "pinned": "1" if pinned else "0"})
        pipe.zadd(self.k("by_model", entry.model), {key: entry.created_at})
        pipe.zadd(self.k("by_envhw", entry.env_digest, entry.hw_digest),
                  {key: entry.created_at})
        pipe.zadd(self.k("entries"), {key: entry.created_at})
        pipe.zadd(self.k("ns", ns), {key: entry.created_at})
        pipe.zadd(self.k("lru"), {key: now})
        pipe.zadd(self.k("lru", ns), {key: now})
        pipe.zadd(self.k("sizes"), {key: entry.size})
        pipe.zadd(self.k("sizes", ns), {key: entry.size})
        for field, n in ((f"{ns}:entries", 1), (f"{ns}:bytes", entry.size),
                         ("*:entries", 1), ("*:bytes", entry.size)):
            pipe.hincrby(self.k("usage"), field, n)
        for d in entry.digests:
            pipe.sadd(self.k("refs", d), key)
        if entry.digests:  # named now; a later delete of the last entry naming one re-adds it
            pipe.srem(self.k("unref"), *entry.digests)

    async def bulk_load(self, entries: list[tuple[NewEntry, float]],
                        blobs: list[tuple[str, int, str]]) -> None:
        """Write many new entries (each with its last-access time) and blob records in large
        pipelines, with no preconditions: restoring a store, or filling one for a benchmark.
        Every key is laid out as `put` and `record_blob` lay it out."""
        fresh = not await self.r.exists(self.k("blobs"))
        named = {d for entry, _ in entries for d in entry.digests}
        for i in range(0, len(blobs), 5000):
            async with self.r.pipeline(transaction=False) as pipe:
                for digest, size, ns in blobs[i:i + 5000]:
                    pipe.hset(self.k("blobs"), digest, size)
                    pipe.incrby(self.k("stored_bytes"), size)
                    self._own_blob(pipe, digest, ns, time.time())
                    if digest not in named:
                        pipe.sadd(self.k("unref"), digest)
                await pipe.execute()
        if fresh:  # every blob here went through the lines above
            await self.r.set(self.k("unref_ready"), 1, nx=True, ex=UNREF_RESEED_S)
        for i in range(0, len(entries), 2000):
            async with self.r.pipeline(transaction=False) as pipe:
                for entry, accessed in entries[i:i + 2000]:
                    self._write_entry(pipe, entry, base.entry_etag(entry.manifest_json),
                                      accessed, pinned=False)
                await pipe.execute()

    def _unindex(self, pipe: Any, key: str, old: dict[bytes, bytes]) -> None:
        """Queue the removal of an entry from every secondary key (inside MULTI)."""
        ns = _str(old.get(b"namespace")) or "default"
        size = int(old.get(b"size", 0))
        pipe.zrem(self.k("by_model", _str(old.get(b"model"))), key)
        pipe.zrem(self.k("by_envhw", _str(old.get(b"env")), _str(old.get(b"hw"))), key)
        for zset in (("entries",), ("ns", ns), ("lru",), ("lru", ns), ("sizes",),
                     ("sizes", ns)):
            pipe.zrem(self.k(*zset), key)
        for field, n in ((f"{ns}:entries", -1), (f"{ns}:bytes", -size), ("*:entries", -1),
                         ("*:bytes", -size)):
            pipe.hincrby(self.k("usage"), field, n)
        for d in _digests(old):
            pipe.srem(self.k("refs", d), key)
            pipe.sadd(self.k("unref"), d)

    async def _infos(self, keys: list[str]) -> list[EntryInfo]:
        """The entries' columns without their manifests, skipping keys with no entry."""
        if not keys:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hmget(self.k("entry", key), _INFO_FIELDS)
            rows = await pipe.execute()
        return [_stored(key, data) for key, row in zip(keys, rows, strict=True)
                if (data := dict(zip(_INFO_FIELDS, row, strict=True))).get(b"model") is not None]

    async def list_entries(self, *, namespace: str | None = None, model: str | None = None,
                           env_digest: str | None = None, hw_digest: str | None = None,
                           limit: int) -> list[StoredEntry]:
        """Newest first from the narrowest zset the filters allow, each page read and
        filtered by one script: one round trip for a publish-side lookup (`env&hw&limit=20`),
        where a ZREVRANGE, a pipelined HMGET of env/hw and one of whole entries took three."""
        if model is not None:
            zkey = self.k("by_model", model)
        elif env_digest is not None and hw_digest is not None:
            zkey = self.k("by_envhw", env_digest, hw_digest)
        elif namespace is not None:
            zkey = self.k("ns", namespace)
        else:
            zkey = self.k("entries")
        filters = [namespace or "", env_digest or "", hw_digest or ""]

        async def op() -> list[StoredEntry]:
            found: list[StoredEntry] = []
            start, page = 0, min(max(limit, 10), 200)
            while len(found) < limit:
                flat = await self._run_script("listed", [zkey, str(start),
                                                         str(start + page - 1), *filters])
                width = 1 + len(LISTED_FIELDS)
                found += [_stored(_str(flat[i]) or "",
                                  dict(zip(LISTED_FIELDS, flat[i + 1:i + width], strict=True)))
                          for i in range(1, len(flat), width)]
                if int(flat[0]) < page:
                    break
                start += page
            found.sort(key=lambda e: (-e.created_at, e.key))
            return found[:limit]

        return await self._do(op)

    async def _zset_infos(self, zkey: str, *, reverse: bool, limit: int,
                          skip_pinned: bool = False, start: int = 0) -> list[EntryInfo]:
        """Entries in the zset's order from rank `start`, read in pages that start at the
        size asked for (the dashboard's top 10 reads 10 entries, not a page of 500) and
        double while pinned entries are skipped."""
        found: list[EntryInfo] = []
        page = max(1, min(SCAN, limit))
        while len(found) < limit:
            read = self.r.zrevrange if reverse else self.r.zrange
            keys = [_str(k) or "" for k in await read(zkey, start, start + page - 1)]
            if not keys:
                break
            for e in await self._infos(keys):
                if not (skip_pinned and e.pinned):
                    found.append(e)
            start += page
            page = min(SCAN, page * 2)
        return found[:limit]

    async def entry_digests(self) -> dict[str, tuple[str, ...]]:
        """In pages of the `entries` zset, each page's digests read by one script per
        SCRIPT_BATCH entries: a pipelined HMGET per entry cost 30 µs of redis-py each
        (30 s at a million), the script's reply 5 µs."""
        found: dict[str, tuple[str, ...]] = {}
        start = 0
        while True:
            async with self._guard():
                page = await self.r.zrange(self.k("entries"), start, start + SCAN - 1)
            if not page:
                return found
            start += SCAN
            keys = [_str(k) or "" for k in page]
            for i in range(0, len(keys), SCRIPT_BATCH):
                part = keys[i:i + SCRIPT_BATCH]
                named = await self._run_script("entry_digests", part)
                found.update((key, tuple(d.decode().split(",")) if d else ())
                             for key, d in zip(part, named, strict=True) if d is not None)

    async def largest_entries(self, *, namespace: str | None, limit: int) -> list[EntryInfo]:
        zkey = self.k("sizes", namespace) if namespace is not None else self.k("sizes")
        return await self._do(lambda: self._zset_infos(zkey, reverse=True, limit=limit))

    async def usage(self, namespace: str | None = None) -> tuple[int, int]:
        ns = namespace if namespace is not None else "*"
        entries, size = await self._do(lambda: self.r.hmget(
            self.k("usage"), [f"{ns}:entries", f"{ns}:bytes"]))
        return int(entries or 0), int(size or 0)

    async def delete(self, key: str, *, unless_pinned: bool = False) -> bool:
        ekey = self.k("entry", key)

        async def op() -> bool:
            async with self.r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(ekey)
                        old = await pipe.hgetall(ekey)
                        if not old or (unless_pinned and _str(old.get(b"pinned")) == "1"):
                            await pipe.unwatch()
                            return False
                        pipe.multi()
                        pipe.delete(ekey)
                        self._unindex(pipe, key, old)
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue

        return await self._do(op)

    async def delete_unpinned(self, keys: list[str]) -> int:
        """Eviction in batches: one script per SCRIPT_BATCH keys, atomic for each entry (no
        WATCH to retry while lookups touch the entries being evicted)."""
        deleted = 0
        for i in range(0, len(keys), SCRIPT_BATCH):
            part = keys[i:i + SCRIPT_BATCH]
            deleted += int(await self._run_script("delete_unpinned", part))
        return deleted

    async def _run_script(self, name: str, args: list[str]) -> Any:
        """One of SCRIPTS on `args` (after the key prefix); registered once per connection
        pool, then run by its hash (EVALSHA, loaded again if the server lost it)."""
        if name not in self._scripts:
            self._scripts[name] = self.r.register_script(SCRIPTS[name])
        script = self._scripts[name]
        return await self._do(lambda: script(args=[self.p, *args]))

    async def set_pinned(self, key: str, pinned: bool) -> bool:
        async def op() -> bool:
            if not await self.r.exists(self.k("entry", key)):
                return False
            await self.r.hset(self.k("entry", key), "pinned", "1" if pinned else "0")
            return True

        return await self._do(op)

    async def lru_entries(self, limit: int, *, namespace: str | None = None,
                          after: EntryInfo | None = None) -> list[EntryInfo]:
        zkey = self.k("lru", namespace) if namespace is not None else self.k("lru")

        async def op() -> list[EntryInfo]:
            start = 0
            if after is not None:  # the rank after it; by its score if it has gone since
                rank = await self.r.zrank(zkey, after.key)
                start = rank + 1 if rank is not None else \
                    await self.r.zcount(zkey, "-inf", f"({after.last_access}")
            return await self._zset_infos(zkey, reverse=False, limit=limit,
                                          skip_pinned=True, start=start)

        return await self._do(op)

    # -- blobs --------------------------------------------------------------------------
    async def record_blob(self, digest: str, size: int, namespace: str) -> bool:
        async def op() -> bool:
            if await self.r.hsetnx(self.k("blobs"), digest, size):
                await self.r.incrby(self.k("stored_bytes"), size)
            async with self.r.pipeline(transaction=False) as pipe:
                self._own_blob(pipe, digest, namespace, time.time())
                pipe.sadd(self.k("unref"), digest)  # GC drops it once it finds it named
                _, new, _, _ = await pipe.execute()
            return bool(new)

        return await self._do(op)

    def _own_blob(self, pipe: Any, digest: str, namespace: str, now: float) -> None:
        """Queue a blob's touch and its ownership by `namespace` (three replies)."""
        pipe.zadd(self.k("blob_touched"), {digest: now})
        pipe.sadd(self.k("owned", namespace), digest)
        pipe.sadd(self.k("blob_owners", digest), namespace)

    async def stored_bytes(self) -> int:
        async def op() -> int:
            raw = await self.r.get(self.k("stored_bytes"))
            return int(raw) if raw is not None else 0

        return await self._do(op)

    async def pending_bytes(self, namespace: str) -> int:
        async def op() -> int:
            total, cursor = 0, 0
            while True:
                cursor, digests = await self.r.sscan(self.k("owned", namespace), cursor,
                                                     count=SCAN)
                if digests:
                    async with self.r.pipeline(transaction=False) as pipe:
                        for d in digests:
                            pipe.scard(self.k("refs", _str(d)))
                            pipe.hget(self.k("blobs"), d)
                        found = await pipe.execute()
                    for refs, size in zip(found[::2], found[1::2], strict=True):
                        if not refs and size is not None:
                            total += int(size)
                if not cursor:
                    return total

        return await self._do(op)

    async def recorded_digests(self) -> set[str]:
        """HSCAN pages, not one HGETALL: that blocks Redis (every lookup) for its length."""
        async def op() -> set[str]:
            found: set[str] = set()
            cursor = 0
            while True:
                cursor, page = await self.r.hscan(self.k("blobs"), cursor, count=SCAN)
                found.update(_str(d) or "" for d in page)
                if not cursor:
                    return found

        return await self._do(op)

    async def reference_counts(self, digests: list[str]) -> dict[str, int]:
        async def op() -> dict[str, int]:
            counts: dict[str, int] = {}
            for i in range(0, len(digests), SCAN):
                part = digests[i:i + SCAN]
                async with self.r.pipeline(transaction=False) as pipe:
                    for d in part:
                        pipe.scard(self.k("refs", d))
                    counts.update(zip(part, map(int, await pipe.execute()), strict=True))
            return counts

        return await self._do(op)

    async def blob_records_of(self, digests: list[str]) -> dict[str, BlobRecord]:
        async def op() -> dict[str, BlobRecord]:
            found: dict[str, BlobRecord] = {}
            for i in range(0, len(digests), SCAN):
                part = digests[i:i + SCAN]
                async with self.r.pipeline(transaction=False) as pipe:
                    pipe.hmget(self.k("blobs"), part)
                    pipe.zmscore(self.k("blob_touched"), part)
                    sizes, touched = await pipe.execute()
                found.update((d, BlobRecord(d, int(size), float(t or 0.0)))
                             for d, size, t in zip(part, sizes, touched, strict=True)
                             if size is not None)
            return found

        return await self._do(op)

    async def unreferenced_blobs(self) -> list[BlobRecord]:
        """From the `unref` candidates, not every blob: the cost follows what was uploaded
        or dereferenced since the last GC (a scan of every blob took 4 s at 300k entries)."""
        async def op() -> list[BlobRecord]:
            if not await self.r.exists(self.k("unref_ready")):
                await self._seed_unreferenced()
            found: list[BlobRecord] = []
            cursor = 0
            while True:
                cursor, page = await self.r.sscan(self.k("unref"), cursor, count=SCAN)
                for i in range(0, len(page), SCRIPT_BATCH):
                    flat = await self._run_script(
                        "unreferenced", [_str(d) or "" for d in page[i:i + SCRIPT_BATCH]])
                    found += [BlobRecord(_str(flat[j]) or "", int(flat[j + 1]),
                                         float(flat[j + 2])) for j in range(0, len(flat), 3)]
                if not cursor:
                    return sorted(set(found), key=lambda b: b.digest)

        return await self._do(op)

    async def _seed_unreferenced(self) -> None:
        """Once per store written before `unref` existed, then once a day (UNREF_RESEED_S):
        every recorded blob becomes a candidate (the plan drops the named ones). Blobs
        recorded meanwhile are added by `record_blob` itself, so setting `unref_ready` after
        the scan loses none."""
        cursor = 0
        while True:
            cursor, page = await self.r.hscan(self.k("blobs"), cursor, count=SCAN)
            if page:
                await self.r.sadd(self.k("unref"), *page)
            if not cursor:
                break
        await self.r.set(self.k("unref_ready"), 1, ex=UNREF_RESEED_S)

    async def touch_blobs(self, digests: list[str]) -> None:
        if digests:
            now = time.time()
            await self._do(lambda: self.r.zadd(self.k("blob_touched"),
                                               dict.fromkeys(digests, now)))

    async def forget_blobs(self, digests: list[str]) -> None:
        for i in range(0, len(digests), SCRIPT_BATCH):
            part = digests[i:i + SCRIPT_BATCH]
            await self._run_script("forget_blobs", part)

    async def owns_blob(self, namespace: str, digest: str) -> bool:
        return bool(await self._do(lambda: self.r.sismember(self.k("owned", namespace),
                                                             digest)))

    # -- tokens -------------------------------------------------------------------------
    async def put_token(self, token: TokenRecord) -> None:
        async def op() -> None:
            await self.r.hset(self.k("token", token.token_id), mapping={
                "name": token.name, "token_hash": token.token_hash,
                "scopes": ",".join(token.scopes), "namespace": token.namespace,
                "created_at": token.created_at, "revoked": "1" if token.revoked else "0",
                **({"expires_at": token.expires_at} if token.expires_at is not None else {})})
            await self.r.zadd(self.k("tokens"), {token.token_id: token.created_at})

        await self._do(op)

    async def get_token(self, token_id: str) -> TokenRecord | None:
        async def op() -> TokenRecord | None:
            data = await self.r.hgetall(self.k("token", token_id))
            if not data:
                return None
            return TokenRecord(token_id, _str(data[b"name"]) or "",
                               _str(data[b"token_hash"]) or "",
                               tuple((_str(data[b"scopes"]) or "").split(",")),
                               _str(data[b"namespace"]) or "", float(data[b"created_at"]),
                               _str(data[b"revoked"]) == "1",
                               float(data[b"expires_at"]) if b"expires_at" in data else None)

        return await self._do(op)

    async def list_tokens(self) -> list[TokenRecord]:
        ids = await self._do(lambda: self.r.zrange(self.k("tokens"), 0, -1))
        found = [await self.get_token(_str(i) or "") for i in ids]
        return [t for t in found if t is not None]

    async def revoke_token(self, token_id: str) -> bool:
        async def op() -> bool:
            if not await self.r.exists(self.k("token", token_id)):
                return False
            await self.r.hset(self.k("token", token_id), "revoked", "1")
            return True

        return await self._do(op)

    # -- events -------------------------------------------------------------------------
    async def add_event(self, namespace: str, event: Event) -> None:
        hour = base.event_hour(event, time.time())
        day = hour // base.DAY * base.DAY
        sums = {c: v for c, v in base.event_counters(event).items() if v}
        periods = [(f"{kind}{suffix}", namespace, period) for suffix, period in
                   (("", hour), ("_day", day)) for kind in ("rollup", "hourly", "misses")]
        miss = event.outcome not in ("hit", "fallback")

        async def op() -> None:
            await self._daily_since()  # before the first daily write
            model, members = await self._admitted(namespace, event, hour, day, miss)
            counters = {f"{model}\t{c}": v for c, v in sums.items()}
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.lpush(self.k("events", namespace), event.to_json())
                pipe.ltrim(self.k("events", namespace), 0, MAX_RAW_EVENTS - 1)
                pipe.sadd(self.k("namespaces"), namespace)
                pipe.sadd(self.k("models", namespace), model)
                for field, value in counters.items():
                    pipe.hincrbyfloat(self.k("total", namespace), field, value)
                for kind, ns, period in periods:  # per model, all models, misses; hour, day
                    key = self.k(kind, ns, period)
                    if kind.startswith("rollup"):
                        for field, value in counters.items():
                            pipe.hincrbyfloat(key, field, value)
                    elif kind.startswith("hourly"):
                        for field, value in sums.items():
                            pipe.hincrbyfloat(key, field, value)
                    elif not miss:
                        continue
                    else:
                        pipe.zincrby(key, 1, members[1 if kind.endswith("_day") else 0])
                    pipe.expire(key, ROLLUP_TTL_S)
                for suffix, period in (("", hour), ("_day", day)):
                    pipe.incr(self.k(f"gen{suffix}", namespace, period))
                    pipe.expire(self.k(f"gen{suffix}", namespace, period), ROLLUP_TTL_S)
                await pipe.execute()

        await self._do(op)

    async def _admitted(self, namespace: str, event: Event, hour: int, day: int,
                        miss: bool) -> tuple[str, tuple[str, str]]:
        """The model name the event counts under (OTHER_MODELS once the namespace has
        MAX_MODELS) and its miss members for the hour's and the day's zsets (OTHER_REASONS
        once that zset holds MAX_REASONS), read in one round trip. Replicas racing past a
        bound overshoot it by at most their number."""
        zsets = (self.k("misses", namespace, hour), self.k("misses_day", namespace, day))
        member = json.dumps([event.model, event.outcome, event.reason[:200]])
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.sismember(self.k("models", namespace), event.model)
            pipe.scard(self.k("models", namespace))
            for zset in zsets if miss else ():
                pipe.zscore(zset, member)
                pipe.zcard(zset)
            known, n_models, *seen = await pipe.execute()
        model = event.model if known or n_models < base.MAX_MODELS else base.OTHER_MODELS
        if not miss:
            return model, ("", "")
        hour_member, day_member = (
            json.dumps([model, event.outcome, event.reason[:200] if score is not None
                        or size < base.MAX_REASONS else base.OTHER_REASONS])
            for score, size in (seen[0:2], seen[2:4]))
        return model, (hour_member, day_member)

    async def _namespaces(self, namespace: str | None) -> list[str]:
        if namespace is not None:
            return [namespace]
        return sorted(_str(n) or "" for n in await self.r.smembers(self.k("namespaces")))

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
        w = base.window(max(since, now - ROLLUP_TTL_S), now, days=daily, days_from=days_from)
        return [(h, self.k(kind, namespace, h), self.k("gen", namespace, h),
                 h + base.HOUR <= now) for h in w.hours] + \
            [(d, self.k(f"{kind}_day", namespace, d), self.k("gen_day", namespace, d),
              d + base.DAY <= now) for d in w.days]

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
                    [sums] = await self._hash_sums([self.k("total", ns)])
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

    # -- locks and health ---------------------------------------------------------------
    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        return bool(await self._do(lambda: self.r.set(
            self.k("lock", name), self._owner, nx=True, px=int(ttl_s * 1000))))

    async def release_lock(self, name: str) -> None:
        async def op() -> None:
            if _str(await self.r.get(self.k("lock", name))) == self._owner:
                await self.r.delete(self.k("lock", name))

        await self._do(op)

    async def ping(self, *, write: bool = False) -> None:
        if write:
            await self._do(lambda: self.r.set(self.k("heartbeat"), time.time()))
        else:
            await self._do(self.r.ping)


LISTED_FIELDS = tuple(f.encode() for f in (
    "model", "namespace", "env", "hw", "digests", "size", "created_at", "updated_at",
    "last_access", "pinned", "manifest", "etag"))
"""The fields the `listed` script returns, in its order."""
_INFO_FIELDS = tuple(f.encode() for f in (
    "namespace", "model", "digests", "size", "created_at", "updated_at", "last_access",
    "pinned"))


def _str(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _digests(data: dict[bytes, bytes]) -> tuple[str, ...]:
    raw = _str(data.get(b"digests")) or ""
    return tuple(raw.split(",")) if raw else ()


def _stored(key: str, data: dict[bytes, bytes]) -> StoredEntry:
    return StoredEntry(
        key=key,
        namespace=_str(data.get(b"namespace")) or "default",
        model=_str(data.get(b"model")) or "",
        digests=_digests(data),
        size=int(data.get(b"size") or 0),
        created_at=float(data[b"created_at"]),
        updated_at=float(data[b"updated_at"]),
        last_access=float(data[b"last_access"]),
        pinned=_str(data.get(b"pinned")) == "1",
        manifest_json=bytes(data.get(b"manifest") or b""),
        etag=_str(data.get(b"etag")) or "",
    )


# The sums below run in a worker thread: at 200 models and a week of hourly rollups they
# are tens of thousands of fields, milliseconds of Python the serving loop must not wait on.

def _decoded(pairs: Iterable[tuple[bytes, Any]]) -> Sums:
    return {_str(name) or "": float(value) for name, value in pairs}


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
            counter = _str(field) or ""
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
