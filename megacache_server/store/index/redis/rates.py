"""RateStore on Redis: a hash per token bucket, taken by one script (`take.lua`), so every
replica draws on the same bucket in one round trip."""

from __future__ import annotations

from megacache_server.store.index.protocols.rates import RateStore
from megacache_server.store.index.redis.connection import RedisConnection, text


class RedisRates(RedisConnection, RateStore):
    async def take(self, bucket: str, rate: float, burst: float, now: float) -> float:
        wait = await self._run_script("take", [bucket, repr(rate), repr(burst), repr(now)])
        return float(text(wait) or 0)
