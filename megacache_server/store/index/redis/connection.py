"""The Redis index's connection, its scripts, and what each of its parts shares.

Batch writes run as Redis scripts (`scripts/*.lua`, loaded here): each runs atomically on
the server, one round trip for a batch. The Redis index therefore needs one Redis (a
primary, with replicas if wanted), not a Redis Cluster: a script's keys are computed inside
it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from megacache_server.errors import ServiceUnavailable
from megacache_server.store.index.redis.keys import Keys

T = TypeVar("T")
SCAN = 500
SCRIPT_BATCH = 200
"""Entries or blobs per server-side script: ~15 commands each, a few ms of Redis time, so
a lookup arriving meanwhile waits little."""

SCRIPTS = {script.stem: script.read_text()
           for script in sorted(Path(__file__).with_name("scripts").glob("*.lua"))}
"""Each script's source by name; every one takes the key prefix as its first argument."""


class RedisConnection:
    """The client, the key names under this index's prefix, and the ways to run commands."""

    def __init__(self, url: str, prefix: str = "megacache:") -> None:
        self.url = url
        self.keys = Keys(prefix)
        self._r: aioredis.Redis | None = None
        self._scripts: dict[str, Any] = {}

    async def open(self) -> None:
        self._r = aioredis.from_url(self.url, socket_timeout=5, socket_connect_timeout=3,
                                    health_check_interval=15)

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None
            self._scripts = {}

    async def ping(self, *, write: bool = False) -> None:
        if write:
            await self._do(lambda: self.r.set(self.keys.heartbeat(), time.time()))
        else:
            await self._do(self.r.ping)

    @property
    def r(self) -> Any:  # redis' own annotations are too loose to check calls against
        if self._r is None:
            raise ServiceUnavailable("index is not open", code="index_unavailable")
        return self._r

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

    async def _run_script(self, name: str, args: Sequence[str | bytes]) -> Any:
        """One of SCRIPTS on `args` (after the key prefix); registered once per connection
        pool, then run by its hash (EVALSHA, loaded again if the server lost it)."""
        if name not in self._scripts:
            self._scripts[name] = self.r.register_script(SCRIPTS[name])
        script = self._scripts[name]
        return await self._do(lambda: script(args=[self.keys.prefix, *args]))


def text(value: Any) -> str | None:
    """A reply's bytes as str (None stays None)."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
