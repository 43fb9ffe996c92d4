"""Index in Redis: shared by many stateless server replicas.

One module per storage protocol of `protocols/` (of the same name), each a class on the
shared connection of `connection.py`; the names of every key are in `keys.py`, the
server-side scripts in `scripts/`. `RedisIndex` is made of those classes.
"""

from __future__ import annotations

import time

from megacache_server.store.index.base import Index
from megacache_server.store.index.protocols.entries import NewEntry, entry_etag
from megacache_server.store.index.redis.blobs import UNREF_RESEED_S, RedisBlobs
from megacache_server.store.index.redis.connection import SCRIPT_BATCH
from megacache_server.store.index.redis.entries import RedisEntries
from megacache_server.store.index.redis.ett_rollups import RedisEttRollups
from megacache_server.store.index.redis.events import RedisEvents
from megacache_server.store.index.redis.jobs import RedisJobs
from megacache_server.store.index.redis.locks import RedisLocks
from megacache_server.store.index.redis.progress import RedisProgress
from megacache_server.store.index.redis.quotas import RedisQuotas
from megacache_server.store.index.redis.rates import RedisRates
from megacache_server.store.index.redis.tokens import RedisTokens
from megacache_server.store.index.redis.trust import RedisTrust


class RedisIndex(RedisEntries, RedisQuotas, RedisBlobs, RedisTokens, RedisEvents, RedisRates,
                 RedisLocks, RedisJobs, RedisTrust, RedisProgress, RedisEttRollups, Index):
    name = "redis"

    async def eviction_facts(self, digests: list[str], now: float
                             ) -> dict[str, tuple[int, int | None]]:
        """One script per SCRIPT_BATCH digests, not three pipelines of a command per blob:
        redis-py's packing and parsing of those was most of a GC plan at a million entries."""
        facts: dict[str, tuple[int, int | None]] = {}
        for i in range(0, len(digests), SCRIPT_BATCH):
            part = digests[i:i + SCRIPT_BATCH]
            flat = await self._run_script("eviction_facts", [repr(now), *part])
            facts.update((d, (int(flat[2 * j]), None if flat[2 * j + 1] is None
                              else int(flat[2 * j + 1])))
                         for j, d in enumerate(part))
        return facts

    async def bulk_load(self, entries: list[tuple[NewEntry, float]],
                        blobs: list[tuple[str, int, str]]) -> None:
        """Write many new entries (each with its last-access time) and blob records in large
        pipelines, with no preconditions: restoring a store, or filling one for a benchmark.
        Every key is laid out as `put` and `record_blob` lay it out."""
        fresh = not await self.r.exists(self.keys.blobs())
        named = {d for entry, _ in entries for d in entry.digests}
        for i in range(0, len(blobs), 5000):
            async with self.r.pipeline(transaction=False) as pipe:
                for digest, size, ns in blobs[i:i + 5000]:
                    pipe.hset(self.keys.blobs(), digest, size)
                    pipe.incrby(self.keys.stored_bytes(), size)
                    self._own_blob(pipe, digest, ns, time.time())
                    if digest not in named:
                        pipe.sadd(self.keys.unref(), digest)
                await pipe.execute()
        if fresh:  # every blob here went through the lines above
            await self.r.set(self.keys.unref_ready(), 1, nx=True, ex=UNREF_RESEED_S)
        for i in range(0, len(entries), 2000):
            async with self.r.pipeline(transaction=False) as pipe:
                for entry, accessed in entries[i:i + 2000]:
                    self._write_entry(pipe, entry, entry_etag(entry.manifest_json),
                                      accessed, pinned=False)
                await pipe.execute()


__all__ = ["RedisIndex"]
