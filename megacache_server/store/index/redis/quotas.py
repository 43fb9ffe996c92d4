"""QuotaStore on Redis: per namespace a zset of hold ids by expiry and a hash of their sizes,
decided by one script (`hold_pending.lua`). The namespace's pending bytes are summed before
the script runs (a scan of its blobs, too long for one script); `pending_gen:{ns}`, which
every recorded upload bumps, is read before them and checked by the script, so an upload
recorded (and its hold released) in between makes the caller read again instead of
deciding on a sum that misses it."""

from __future__ import annotations

from megacache_server.errors import ServiceUnavailable
from megacache_server.store.index.protocols.quotas import PendingHold, QuotaStore
from megacache_server.store.index.redis.blobs import RedisBlobs

RETRIES = 20
"""Reads of the pending sum a hold may take while uploads keep being recorded."""


class RedisQuotas(RedisBlobs, QuotaStore):
    """On the ledger's `pending_bytes` (a subclass: the sum is the ledger's to make)."""

    async def hold_pending(self, namespace: str, hold_id: str, size: int, cap: int,
                           ttl_s: float, now: float) -> PendingHold:
        for _ in range(RETRIES):
            generation = await self._do(lambda: self.r.get(self.keys.pending_gen(namespace)))
            pending = await self.pending_bytes(namespace)
            granted, pending_at, held = await self._run_script("hold_pending", [
                namespace, hold_id, str(size), str(cap), repr(ttl_s), repr(now),
                str(pending), (generation or b"0").decode()])
            if int(granted) >= 0:
                return PendingHold(bool(int(granted)), int(pending_at), int(held))
        raise ServiceUnavailable(f"namespace {namespace!r} records uploads faster than its "
                                 "pending quota can be read: try again", code="busy",
                                 headers={"retry-after": "1"})

    async def release_pending(self, namespace: str, hold_id: str) -> None:
        async def op() -> None:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.zrem(self.keys.holds(namespace), hold_id)
                pipe.hdel(self.keys.hold_sizes(namespace), hold_id)
                await pipe.execute()

        await self._do(op)
