"""Where a garbage collection runs: here (`LocalCollector`), or in a child process
(`SubprocessCollector`, the server's).

A collection over a large store reads hundreds of thousands of index rows into Python
objects and makes thousands of store calls. In the serving process, on the event loop or in
a thread beside it, that work holds the GIL for the lookups queued behind it: the pages of
the plan parsed on the loop, CPython's full garbage collections over the plan's objects and
single C calls over 100k items (sorting, freeing the plan), each tens to hundreds of
milliseconds on a large store. A child process shares no GIL and no heap with the server:
the server only waits for its answer. The child is the `gc` command, so the rules are the
`LocalCollector`'s, with this process's settings handed over as MEGACACHE_* variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from typing import Protocol

from megacache_server.errors import ServiceUnavailable
from megacache_server.service.housekeeping import eviction
from megacache_server.service.housekeeping.eviction import GcPlan, GcResult
from megacache_server.settings import Settings
from megacache_server.store.index.base import Index
from megacache_server.store.storage import Storage

log = logging.getLogger("megacache.gc")

GC_LOCK = "gc"
GC_LOCK_TTL_S = 600.0
"""Longer than any collect takes; a replica that dies holding it blocks GC this long."""
GC_NICE = 19
"""The child's lower CPU priority (`gc --nice`), the lowest: a collection has no deadline
and on a small host it would otherwise take a core the lookups need, descheduling the
serving loop for tens of milliseconds. Nice 19 still runs whenever a core is idle.
SCHED_IDLE, which never runs while anything else wants the core, makes lookups no faster
than the noise between runs, and on a busy server it could starve a collection that holds
the GC lock."""
STOP_WAIT_S = 30.0
"""How long a collection interrupted by shutdown gets to release the GC lock and exit."""


class Collector(Protocol):
    """Runs one collection: entries evicted over `budget` (None: the configured one) and
    unreferenced blobs deleted. None when another collector holds the GC lock."""

    async def collect(self, budget: int | None) -> GcResult | None: ...


class LocalCollector:
    """Collects in this process, one collector at a time across every process and replica
    (the GC lock): what `megacache-server gc` runs, and so what a child collects with."""

    def __init__(self, settings: Settings, storage: Storage) -> None:
        self.settings = settings
        self.storage = storage

    async def plan(self, *, budget: int | None = None) -> GcPlan:
        return await eviction.plan(self.storage, budget=budget if budget is not None
                                   else self.settings.budget(),
                                   grace_s=self.settings.gc_grace_s,
                                   low_water=self.settings.gc_low_water)

    async def collect(self, budget: int | None = None, *,
                      gc_plan: GcPlan | None = None) -> GcResult | None:
        """Evict and delete as `gc_plan` says (made now when not given), then prune old
        events, expired job records and the progress of jobs silent for the retention."""
        index = self.storage.index
        if not await index.acquire_lock(GC_LOCK, ttl_s=GC_LOCK_TTL_S):
            return None
        try:
            gc_plan = gc_plan or await self.plan(budget=budget)
            done = GcResult()
            if gc_plan.evict or gc_plan.delete:
                done = await eviction.apply(self.storage, gc_plan)
            now = time.time()
            await index.prune_events(
                raw_before=now - self.settings.event_retention_days * 86400,
                rollups_before=now - self.settings.rollup_retention_days * 86400)
            await index.prune_jobs(now)
            await index.prune_progress(now - self.settings.event_retention_days * 86400)
            return done
        finally:
            await index.release_lock(GC_LOCK)


class SubprocessCollector:
    """`collect(budget)` runs one collection in a child process and returns what it did."""

    def __init__(self, settings: Settings, index: Index) -> None:
        self.settings = settings
        self.index = index

    async def collect(self, budget: int | None) -> GcResult | None:
        """What the child collected; None when another collector held the GC lock. The
        access times this process buffers are written first, so its LRU order is the one
        the child's plan reads."""
        await self.index.flush_access()
        env = {**os.environ, **self.settings.environment()}
        if budget is not None:
            env["MEGACACHE_STORE_BUDGET"] = str(budget)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "megacache_server", "gc", "--json", "--nice", str(GC_NICE),
            env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:  # shutting down: let it release the lock first
            await _interrupt(proc)
            raise
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            answer = json.loads(lines[-1]) if lines else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            detail = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise ServiceUnavailable(f"gc exited with {proc.returncode}: {detail}",
                                     code="gc_failed")
        if answer.get("locked"):
            return None
        return GcResult(**{k: int(answer.get(k, 0)) for k in
                           ("evicted", "deleted", "freed_bytes", "spared", "failed")})


async def _interrupt(proc: asyncio.subprocess.Process) -> None:
    """SIGINT first: the child unwinds and releases the GC lock; killed if it does not."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        log.warning("gc child did not stop in %.0fs; killed (its lock expires on its own)",
                    STOP_WAIT_S)
