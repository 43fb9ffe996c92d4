"""Garbage collection out of the serving process: `megacache-server gc --json` in a child.

A collection over a large store reads hundreds of thousands of index rows into Python
objects and makes thousands of store calls. In the serving process, on the event loop or in
a thread beside it, that work holds the GIL for the lookups queued behind it: the pages of
the plan parsed on the loop, CPython's full garbage collections over the plan's objects and
single C calls over 100k items (sorting, freeing the plan), each tens to hundreds of
milliseconds on a large store. A child process shares no GIL and no heap with the server:
the server only waits for its answer. The child is the `gc` command, so the rules are the
cache's own (`Cache.collect`), with this process's settings handed over as MEGACACHE_*
variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys

from megacache_server.errors import ServiceUnavailable
from megacache_server.service.eviction import GcResult
from megacache_server.settings import Settings

log = logging.getLogger("megacache.gc")

GC_NICE = 19
"""The child's lower CPU priority (`gc --nice`), the lowest: a collection has no deadline
and on a small host it would otherwise take a core the lookups need, descheduling the
serving loop for tens of milliseconds. Nice 19 still runs whenever a core is idle.
SCHED_IDLE, which never runs while anything else wants the core, makes lookups no faster
than the noise between runs, and on a busy server it could starve a collection that holds
the GC lock."""
STOP_WAIT_S = 30.0
"""How long a collection interrupted by shutdown gets to release the GC lock and exit."""


class SubprocessCollector:
    """`collect(budget)` runs one collection in a child process and returns what it did."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def collect(self, budget: int | None) -> GcResult | None:
        """What the child collected; None when another collector held the GC lock."""
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
