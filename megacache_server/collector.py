"""Garbage collection off the serving loop: a thread with an event loop and storage of its own.

A collection over a large store reads hundreds of thousands of index rows and makes
thousands of store calls. On the loop that serves requests, every step of it that parses a
page of rows is a wait for the lookups queued behind it (scale_bench, lookups during a GC
evicting 10%: up to 79 ms at a million SQLite entries, 114 ms at 100k on Redis). Here the
whole collection runs on its own loop in its own thread, with its own index and blob store
connections, so the serving loop waits only for the GIL, which it gets back within
`app.GIL_SWITCH_S`. The rules are the cache's own: this runs `Cache.collect` there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from megacache_server.eviction import GcResult
from megacache_server.settings import Settings
from megacache_server.storage import Storage, build_storage

T = TypeVar("T")

CLOSE_WAIT_S = 30.0
"""How long shutdown waits for a collection to unwind (it releases the GC lock)."""


class OffLoopCollector:
    """`collect(budget)` from the serving loop; the work happens on the collector's loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._storage: Storage | None = None
        self._start_lock = threading.Lock()

    async def collect(self, budget: int | None) -> GcResult | None:
        return await self._submit(self._collect(budget))

    async def close(self) -> None:
        """Stop a collection in progress, close the collector's storage, end its thread."""
        if self._loop is None or self._thread is None:
            return
        try:
            await asyncio.wait_for(self._submit(self._shutdown()), CLOSE_WAIT_S)
        finally:
            loop, thread = self._loop, self._thread
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join, CLOSE_WAIT_S)
            if not thread.is_alive():
                loop.close()
            self._loop, self._thread = None, None

    async def _submit(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._running_loop())
        return await asyncio.wrap_future(future)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever,
                                                name="megacache-gc", daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop

    # -- on the collector's loop ----------------------------------------------------------
    async def _collect(self, budget: int | None) -> GcResult | None:
        from megacache_server.cache import Cache  # cache.py names this module's class

        if self._storage is None:
            storage = build_storage(self.settings)
            await storage.open()
            self._storage = storage
        return await Cache(self._storage).collect(budget=budget)

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._storage is not None:
            await self._storage.close()
            self._storage = None
