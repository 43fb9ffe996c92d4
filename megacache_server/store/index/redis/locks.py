"""LockStore on Redis: a key per held lock, set only if absent, holding its owner and
expiring on its own, so a replica that dies holding it blocks no one for longer."""

from __future__ import annotations

import uuid

from megacache_server.store.index.protocols.locks import LockStore
from megacache_server.store.index.redis.connection import RedisConnection, text


class RedisLocks(RedisConnection, LockStore):
    def __init__(self, url: str, prefix: str = "megacache:") -> None:
        super().__init__(url, prefix)
        self._owner = uuid.uuid4().hex

    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        return bool(await self._do(lambda: self.r.set(
            self.keys.lock(name), self._owner, nx=True, px=int(ttl_s * 1000))))

    async def release_lock(self, name: str) -> None:
        async def op() -> None:
            if text(await self.r.get(self.keys.lock(name))) == self._owner:
                await self.r.delete(self.keys.lock(name))

        await self._do(op)
