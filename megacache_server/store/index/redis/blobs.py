"""BlobLedger on Redis: a hash of sizes, a zset of touch times, a set of owners per blob and
of entries naming it (`keys.py`), and `unref`, the blobs that may have lost their last
reference: what GC reads instead of every blob."""

from __future__ import annotations

import time
from typing import Any

from megacache_server.store.index.protocols.blobs import BlobLedger, BlobRecord
from megacache_server.store.index.redis.connection import (
    SCAN,
    SCRIPT_BATCH,
    RedisConnection,
    text,
)

UNREF_RESEED_S = 86400
"""How long `unref` is trusted before a GC seeds it from every blob again: a blob can miss
it only through a crash between two round trips or an older replica deleting entries, and
then waits at most this long to be collected."""


class RedisBlobs(RedisConnection, BlobLedger):
    async def record_blob(self, digest: str, size: int, namespace: str) -> bool:
        async def op() -> bool:
            if await self.r.hsetnx(self.keys.blobs(), digest, size):
                await self.r.incrby(self.keys.stored_bytes(), size)
                await self.r.zadd(self.keys.blob_verified(), {digest: time.time()}, nx=True)
            async with self.r.pipeline(transaction=False) as pipe:
                self._own_blob(pipe, digest, namespace, time.time())
                pipe.sadd(self.keys.unref(), digest)  # GC drops it once it finds it named
                pipe.incr(self.keys.pending_gen(namespace))  # after the ownership: quotas
                _, new, _, _, _ = await pipe.execute()
            return bool(new)

        return await self._do(op)

    def _own_blob(self, pipe: Any, digest: str, namespace: str, now: float) -> None:
        """Queue a blob's touch and its ownership by `namespace` (three replies)."""
        pipe.zadd(self.keys.blob_touched(), {digest: now})
        pipe.sadd(self.keys.owned(namespace), digest)
        pipe.sadd(self.keys.blob_owners(digest), namespace)

    async def stored_bytes(self) -> int:
        async def op() -> int:
            raw = await self.r.get(self.keys.stored_bytes())
            return int(raw) if raw is not None else 0

        return await self._do(op)

    async def pending_bytes(self, namespace: str) -> int:
        """The namespace's blobs read in SSCAN pages, each page summed by one script
        (`pending.lua`: recorded, and named by none of the namespace's own entries)."""
        total, cursor = 0, 0
        while True:
            async with self._guard():
                cursor, digests = await self.r.sscan(self.keys.owned(namespace), cursor,
                                                     count=SCAN)
            for i in range(0, len(digests), SCRIPT_BATCH):
                total += int(await self._run_script("pending", [
                    namespace, *(text(d) or "" for d in digests[i:i + SCRIPT_BATCH])]))
            if not cursor:
                return total

    async def recorded_digests(self) -> set[str]:
        """HSCAN pages, not one HGETALL: that blocks Redis (every lookup) for its length."""
        async def op() -> set[str]:
            found: set[str] = set()
            cursor = 0
            while True:
                cursor, page = await self.r.hscan(self.keys.blobs(), cursor, count=SCAN)
                found.update(text(d) or "" for d in page)
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
                        pipe.scard(self.keys.refs(d))
                    counts.update(zip(part, map(int, await pipe.execute()), strict=True))
            return counts

        return await self._do(op)

    async def blob_records_of(self, digests: list[str]) -> dict[str, BlobRecord]:
        async def op() -> dict[str, BlobRecord]:
            found: dict[str, BlobRecord] = {}
            for i in range(0, len(digests), SCAN):
                part = digests[i:i + SCAN]
                async with self.r.pipeline(transaction=False) as pipe:
                    pipe.hmget(self.keys.blobs(), part)
                    pipe.zmscore(self.keys.blob_touched(), part)
                    sizes, touched = await pipe.execute()
                found.update((d, BlobRecord(d, int(size), float(t or 0.0)))
                             for d, size, t in zip(part, sizes, touched, strict=True)
                             if size is not None)
            return found

        return await self._do(op)

    async def unreferenced_blobs(self) -> list[BlobRecord]:
        """From the `unref` candidates, not every blob: the cost follows what was uploaded
        or dereferenced since the last GC, not the size of the store."""
        async def op() -> list[BlobRecord]:
            if not await self.r.exists(self.keys.unref_ready()):
                await self._seed_unreferenced()
            found: list[BlobRecord] = []
            cursor = 0
            while True:
                cursor, page = await self.r.sscan(self.keys.unref(), cursor, count=SCAN)
                for i in range(0, len(page), SCRIPT_BATCH):
                    flat = await self._run_script(
                        "unreferenced", [text(d) or "" for d in page[i:i + SCRIPT_BATCH]])
                    found += [BlobRecord(text(flat[j]) or "", int(flat[j + 1]),
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
            cursor, page = await self.r.hscan(self.keys.blobs(), cursor, count=SCAN)
            if page:
                await self.r.sadd(self.keys.unref(), *page)
            if not cursor:
                break
        await self.r.set(self.keys.unref_ready(), 1, ex=UNREF_RESEED_S)

    async def touch_blobs(self, digests: list[str]) -> None:
        if digests:
            now = time.time()
            await self._do(lambda: self.r.zadd(self.keys.blob_touched(),
                                               dict.fromkeys(digests, now)))

    async def forget_blobs(self, digests: list[str]) -> None:
        for i in range(0, len(digests), SCRIPT_BATCH):
            part = digests[i:i + SCRIPT_BATCH]
            await self._run_script("forget_blobs", part)

    async def owns_blob(self, namespace: str, digest: str) -> bool:
        return bool(await self._do(lambda: self.r.sismember(self.keys.owned(namespace),
                                                             digest)))
