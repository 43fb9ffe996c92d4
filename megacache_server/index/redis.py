"""Index in Redis: shared by many stateless server replicas.

Keys (all under a prefix, default `megacache:`):
  entry:{key}          hash   manifest, etag, model, env, hw, times, pinned
  entry_blobs:{key}    set    digests the entry names
  refs:{digest}        set    entry keys naming the blob (garbage collection)
  by_model:{model}     zset   entry keys by created_at (listing, fallback lookup)
  entries              zset   every entry key by created_at
  lru                  zset   entry keys by last access (eviction)
  blobs                hash   digest → size;  blob_touched  zset digest → last touch
  stored_bytes         int    sum of recorded blob sizes (the store budget)
  events               zset   recent client events by time (stats, dashboard)

Conditional writes use WATCH/MULTI on the entry hash, so check-then-write is atomic across
replicas, the same contract the SQLite index keeps with BEGIN IMMEDIATE.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from megacache_client.events import Event
from megacache_server.errors import ServiceUnavailable
from megacache_server.index.base import (
    BlobRecord,
    Index,
    ModelStats,
    Precondition,
    StoredEntry,
    TokenRecord,
    aggregate_stats,
    check_precondition,
    entry_etag,
)

T = TypeVar("T")
MAX_EVENTS = 50_000


class RedisIndex(Index):
    name = "redis"

    def __init__(self, url: str, prefix: str = "megacache:") -> None:
        self.url = url
        self.p = prefix
        self._r: aioredis.Redis | None = None
        self._owner = uuid.uuid4().hex

    async def open(self) -> None:
        self._r = aioredis.from_url(self.url, socket_timeout=5, socket_connect_timeout=3,
                                    health_check_interval=15)

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None

    @property
    def r(self) -> Any:  # redis' own annotations are too loose to check calls against
        if self._r is None:
            raise ServiceUnavailable("index is not open", code="index_unavailable")
        return self._r

    def k(self, *parts: str | None) -> str:
        return self.p + ":".join(p or "" for p in parts)

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
            if touch:
                now = time.time()
                async with self.r.pipeline(transaction=False) as pipe:
                    pipe.hset(self.k("entry", key), "last_access", now)
                    pipe.zadd(self.k("lru"), {key: now})
                    await pipe.execute()
            return _entry(key, data)

        return await self._do(op)

    async def put(
        self,
        key: str,
        manifest_json: bytes,
        *,
        model: str,
        env_digest: str,
        hw_digest: str,
        blob_digests: list[str],
        created_at: float,
        condition: Precondition,
        namespace: str = "default",
    ) -> tuple[StoredEntry, bool]:
        etag = entry_etag(manifest_json)
        ekey, bkey = self.k("entry", key), self.k("entry_blobs", key)

        async def op() -> tuple[StoredEntry, bool]:
            async with self.r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(ekey, bkey)
                        current, old_model, pinned = await pipe.hmget(
                            ekey, ["etag", "model", "pinned"])
                        check_precondition(condition, _str(current))
                        old_blobs = {_str(d) for d in await pipe.smembers(bkey)}
                        now = time.time()
                        pipe.multi()
                        pipe.hset(ekey, mapping={
                            "manifest": manifest_json, "etag": etag, "model": model,
                            "env": env_digest, "hw": hw_digest, "created_at": created_at,
                            "updated_at": now, "last_access": now, "namespace": namespace,
                            "pinned": _str(pinned) or "0"})
                        if old_model is not None and _str(old_model) != model:
                            pipe.zrem(self.k("by_model", _str(old_model) or ""), key)
                        pipe.zadd(self.k("by_model", model), {key: created_at})
                        pipe.zadd(self.k("entries"), {key: created_at})
                        pipe.zadd(self.k("lru"), {key: now})
                        pipe.delete(bkey)
                        if blob_digests:
                            pipe.sadd(bkey, *blob_digests)
                        for d in old_blobs - set(blob_digests):
                            pipe.srem(self.k("refs", d), key)
                        for d in blob_digests:
                            pipe.sadd(self.k("refs", d), key)
                        await pipe.execute()
                        entry = StoredEntry(key, manifest_json, etag, created_at, now, now,
                                            _str(pinned) == "1")
                        return entry, current is None
                    except WatchError:
                        continue

        return await self._do(op)

    async def list_entries(
        self, *, model: str | None, env_digest: str | None, hw_digest: str | None, limit: int,
        namespace: str | None = None,
    ) -> list[StoredEntry]:
        async def op() -> list[StoredEntry]:
            zkey = self.k("by_model", model) if model is not None else self.k("entries")
            found: list[StoredEntry] = []
            start, page = 0, max(limit, 100)
            while len(found) < limit:
                keys = [_str(k) or "" for k in
                        await self.r.zrevrange(zkey, start, start + page - 1)]
                if not keys:
                    break
                async with self.r.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.hgetall(self.k("entry", key))
                    rows = await pipe.execute()
                for key, data in zip(keys, rows, strict=True):
                    if not data:
                        continue
                    if env_digest is not None and _str(data.get(b"env")) != env_digest:
                        continue
                    if hw_digest is not None and _str(data.get(b"hw")) != hw_digest:
                        continue
                    if namespace is not None and \
                            (_str(data.get(b"namespace")) or "default") != namespace:
                        continue
                    found.append(_entry(key, data))
                start += page
            found.sort(key=lambda e: (-e.created_at, e.key))
            return found[:limit]

        return await self._do(op)

    async def entry_count(self) -> int:
        return int(await self._do(lambda: self.r.zcard(self.k("entries"))))

    async def delete(self, key: str) -> bool:
        ekey, bkey = self.k("entry", key), self.k("entry_blobs", key)

        async def op() -> bool:
            async with self.r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(ekey, bkey)
                        model = await pipe.hget(ekey, "model")
                        if model is None:
                            await pipe.unwatch()
                            return False
                        blobs = [_str(d) or "" for d in await pipe.smembers(bkey)]
                        pipe.multi()
                        pipe.delete(ekey, bkey)
                        pipe.zrem(self.k("by_model", _str(model) or ""), key)
                        pipe.zrem(self.k("entries"), key)
                        pipe.zrem(self.k("lru"), key)
                        for d in blobs:
                            pipe.srem(self.k("refs", d), key)
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue

        return await self._do(op)

    async def set_pinned(self, key: str, pinned: bool) -> bool:
        async def op() -> bool:
            if not await self.r.exists(self.k("entry", key)):
                return False
            await self.r.hset(self.k("entry", key), "pinned", "1" if pinned else "0")
            return True

        return await self._do(op)

    async def lru_entries(self, limit: int) -> list[StoredEntry]:
        async def op() -> list[StoredEntry]:
            found: list[StoredEntry] = []
            start = 0
            while len(found) < limit:
                keys = [_str(k) or "" for k in
                        await self.r.zrange(self.k("lru"), start, start + 199)]
                if not keys:
                    break
                for key in keys:
                    data = await self.r.hgetall(self.k("entry", key))
                    if data and _str(data.get(b"pinned")) != "1":
                        found.append(_entry(key, data))
                start += 200
            return found[:limit]

        return await self._do(op)

    # -- blobs --------------------------------------------------------------------------
    async def record_blob(self, digest: str, size: int) -> None:
        async def op() -> None:
            if await self.r.hsetnx(self.k("blobs"), digest, size):
                await self.r.incrby(self.k("stored_bytes"), size)
            await self.r.zadd(self.k("blob_touched"), {digest: time.time()})

        await self._do(op)

    async def stored_bytes(self) -> int:
        return await self._do(lambda: self._int(self.r.get(self.k("stored_bytes"))))

    async def _int(self, value: Awaitable[Any]) -> int:
        raw = await value
        return int(raw) if raw is not None else 0

    async def blob_records(self) -> list[BlobRecord]:
        async def op() -> list[BlobRecord]:
            sizes = await self.r.hgetall(self.k("blobs"))
            touched = dict(await self.r.zrange(self.k("blob_touched"), 0, -1, withscores=True))
            return sorted((BlobRecord(_str(d) or "", int(s), float(touched.get(d, 0.0)))
                           for d, s in sizes.items()), key=lambda b: b.digest)

        return await self._do(op)

    async def blob_record(self, digest: str) -> BlobRecord | None:
        async def op() -> BlobRecord | None:
            size = await self.r.hget(self.k("blobs"), digest)
            if size is None:
                return None
            touched = await self.r.zscore(self.k("blob_touched"), digest)
            return BlobRecord(digest, int(size), float(touched or 0.0))

        return await self._do(op)

    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        return bool(await self._do(lambda: self.r.set(
            self.k("lock", name), self._owner, nx=True, px=int(ttl_s * 1000))))

    async def release_lock(self, name: str) -> None:
        async def op() -> None:
            if _str(await self.r.get(self.k("lock", name))) == self._owner:
                await self.r.delete(self.k("lock", name))

        await self._do(op)

    async def referenced(self, digests: list[str]) -> set[str]:
        async def op() -> set[str]:
            async with self.r.pipeline(transaction=False) as pipe:
                for d in digests:
                    pipe.scard(self.k("refs", d))
                counts = await pipe.execute()
            return {d for d, n in zip(digests, counts, strict=True) if n}

        return await self._do(op)

    async def touch_blobs(self, digests: list[str]) -> None:
        if digests:
            now = time.time()
            await self._do(lambda: self.r.zadd(self.k("blob_touched"),
                                               dict.fromkeys(digests, now)))

    async def forget_blob(self, digest: str) -> None:
        async def op() -> None:
            size = await self.r.hget(self.k("blobs"), digest)
            if size is not None and await self.r.hdel(self.k("blobs"), digest):
                await self.r.decrby(self.k("stored_bytes"), int(size))
            await self.r.zrem(self.k("blob_touched"), digest)

        await self._do(op)

    # -- namespaces and tokens ---------------------------------------------------------
    async def own_blob(self, namespace: str, digest: str) -> bool:
        return bool(await self._do(lambda: self.r.sadd(self.k("owned", namespace), digest)))

    async def owns_blob(self, namespace: str, digest: str) -> bool:
        return bool(await self._do(lambda: self.r.sismember(self.k("owned", namespace),
                                                             digest)))

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
    async def add_event(self, event: Event) -> None:
        member = uuid.uuid4().hex + event.model_dump_json()

        async def op() -> None:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.zadd(self.k("events"), {member: event.created_at.timestamp()})
                pipe.zremrangebyrank(self.k("events"), 0, -MAX_EVENTS - 1)
                await pipe.execute()

        await self._do(op)

    async def events_since(self, since: float, limit: int) -> list[Event]:
        raw = await self._do(lambda: self.r.zrevrangebyscore(
            self.k("events"), "+inf", since, start=0, num=limit))
        return [Event.model_validate_json(member[32:]) for member in raw]

    async def stats(self, *, since: float | None = None) -> list[ModelStats]:
        async def op() -> list[ModelStats]:
            raw = await self.r.zrangebyscore(self.k("events"), since or 0.0, "+inf")
            groups: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0, 0, 0])
            for member in raw:
                e = Event.model_validate_json(member[32:])
                g = groups[(e.model, e.outcome)]
                g[0] += 1
                g[1] += e.compile_s
                g[2] += e.saved_s
                g[3] += e.bytes_down
                g[4] += e.bytes_up
            rows = [(m, o, int(g[0]), g[1], g[2], int(g[3]), int(g[4]))
                    for (m, o), g in groups.items()]
            return aggregate_stats(rows)

        return await self._do(op)

    async def ping(self) -> None:
        await self._do(self.r.ping)


def _str(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _entry(key: str, data: dict[bytes, bytes]) -> StoredEntry:
    return StoredEntry(
        key=key,
        manifest_json=bytes(data[b"manifest"]),
        etag=_str(data[b"etag"]) or "",
        created_at=float(data[b"created_at"]),
        updated_at=float(data[b"updated_at"]),
        last_access=float(data[b"last_access"]),
        pinned=_str(data.get(b"pinned")) == "1",
    )
