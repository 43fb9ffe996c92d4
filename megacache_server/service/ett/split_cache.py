"""Jobs' ETT splits for the views over many jobs (dashboard, stats, jobs, `/metrics`), at
the cost of what changed since the last read, not of the jobs' history.

A fleet heartbeats every few seconds, and every heartbeat moves its job's `last_seen`, so
a reader that kept whole splits keyed by `last_seen` (as this server once did) re-read and
re-split every attempt of nearly every job at each refresh: a tenant with 1,000 jobs of 64
attempts made each dashboard 64,000 summaries to decode and split, and other tenants'
lookups waited behind it. A heartbeat changes one attempt, its job's last; so this keeps,
per job, the split of the attempts before the last (`ett.Prefix`, under their stamps:
`index.attempt_stamps`) and the last attempt's summary, and on a read asks the index
which attempts changed, reads only those, and joins (`ett.join`). A job whose older
attempts changed (rare: a late record) is read whole, once.

What is kept is bounded in bytes (`MEGACACHE_SPLIT_CACHE_BYTES`, 192 MiB; each kept job
counted by `kept_bytes`, measured: #58) and in attempts (`MAX_KEPT_ATTEMPTS`). Full, it
makes room from the least recently read jobs not read for `RECENT_S`, and keeps no new one
while every kept job is in use: a view over more jobs than fit (a namespace's 1,000 jobs
of 64 attempts of 55 records: ~470 MB) then re-splits the ones that do not fit at each
read, not all of them (least-recently-used eviction under a cyclic scan larger than the
cache keeps nothing a scan reads again). Reads of one namespace go through its `Lane`:
one at a time, and at most `VIEW_SHARE` of the process's time: a tenant reloading its
dashboard from many tabs in a loop queues behind itself, not in front of everyone's
lookups.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from anyio import to_thread

from megacache_server.service.ett import split as ett
from megacache_server.store.index.base import Index
from megacache_server.store.index.progress import AttemptProgress, JobProgress, JobStamps

MAX_KEPT_ATTEMPTS = 100_000
"""Attempts whose splits this process keeps between reads (at most; the bytes bound first)."""
MAX_KEPT_BYTES = 192 * 1024 * 1024
"""The bytes the kept splits may take, by `kept_bytes` (`MEGACACHE_SPLIT_CACHE_BYTES`):
a namespace's 1,000 jobs of 64 short attempts (~170 MB) fit."""
JOB_BYTES = 4096
ATTEMPT_BYTES = 2048
SEGMENT_BYTES = 128
"""What a kept job takes, measured with tracemalloc over 100 jobs of 64 attempts: 1.74 KB
an attempt of 2 segments (start, training), 2.04 KB of 4, 7.43 KB of 54 (26 heartbeats and
26 checkpoint saves): ~1.5 KB an attempt and ~110 B a segment, rounded up. The docstring
once said ~1 KB an attempt: the 100,000-attempt bound was then up to ~0.75 GB."""
RECENT_S = 30.0
"""A kept job read this recently is in use: room is not made by dropping it."""
LIVE_CACHE_S = 15.0
"""A live job's split is reused this long (it stops being live by the clock, not by a
write)."""

VIEW_SHARE = 0.25
"""The share of a server process's time one namespace's views may take: after a read
that took `d` seconds, the namespace's next one starts no sooner than `d * (1/share - 1)`
later (at most MAX_VIEW_WAIT_S). A dashboard refreshed every few seconds never waits."""
MAX_VIEW_WAIT_S = 2.0

Key = tuple[str, str]


class Lane:
    """One namespace's view reads (`async with lane:`): one at a time, and at most
    VIEW_SHARE of the time. Re-entered by the task that holds it (a view's whole request
    holds its lane, `service.limits.views`, and the splits it reads take it again) at no cost."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._next_at = 0.0
        self._began = 0.0
        self._owner: asyncio.Task[object] | None = None
        self._depth = 0

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is not None and task is self._owner:
            self._depth += 1
            return
        await self._lock.acquire()
        try:
            wait = self._next_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(min(wait, MAX_VIEW_WAIT_S))
        except BaseException:  # cancelled while waiting: the next reader goes
            self._lock.release()
            raise
        self._owner, self._depth = task, 1
        self._began = time.monotonic()

    async def __aexit__(self, *_: object) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        now = time.monotonic()
        self._next_at = now + (now - self._began) * (1 / VIEW_SHARE - 1)
        self._owner = None
        self._lock.release()


@dataclass
class _Kept:
    last_seen: float
    compile_key: tuple[tuple[int, float], ...]
    stamps: JobStamps
    before: ett.Prefix
    last: AttemptProgress
    split: ett.JobSplit
    split_at: float
    size: int = 0
    read_at: float = 0.0


class SplitCache:
    """The splits of a namespace's jobs, read incrementally (see the module)."""

    def __init__(self, index: Index, max_attempts: int = MAX_KEPT_ATTEMPTS,
                 max_bytes: int = MAX_KEPT_BYTES) -> None:
        self.index = index
        self.max_attempts = max_attempts
        self.max_bytes = max_bytes
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()
        self._mutex = threading.Lock()
        """Two namespaces' reads (and the operator's, over all) build in threads at once."""
        self.held = 0
        """Attempts the kept splits stand for."""
        self.held_bytes = 0
        """What the kept splits take, by `kept_bytes`."""
        self._lanes: dict[str | None, Lane] = {}
        self.read_attempts = 0
        """Attempt summaries read from the index and decoded, in all (what a read costs)."""

    def lane(self, scope: str | None) -> Lane:
        """The namespace's `Lane` (None: the operator's, every namespace)."""
        return self._lanes.setdefault(scope, Lane())

    async def splits(self, jobs: list[tuple[str, str, float]],
                     compile_s: Callable[[str, str], dict[int, float]]) -> list[ett.JobSplit]:
        """The splits of `jobs` ((namespace, job, last_seen), in the order given; a job
        with no attempts left is left out), compile seconds per attempt by `compile_s`:
        unchanged jobs as kept, those whose attempts before the last are as kept by
        reading their last attempt (if it changed), the rest read whole."""
        now = time.time()
        given = {(ns, job): (seen, compile_s(ns, job)) for ns, job, seen in jobs}
        same = {key: kept for key, (seen, cs) in given.items()
                if (kept := self._kept.get(key)) is not None and kept.last_seen == seen
                and kept.compile_key == _key(cs)}
        changed = [key for key in given if key not in same]
        stamps = await self.index.attempt_stamps(changed) if changed else {}
        by_last = {key: kept for key in changed if key in stamps
                   and (kept := self._kept.get(key)) is not None
                   and kept.compile_key == _key(given[key][1])
                   and stamps[key].prefix is not None
                   and stamps[key].prefix == kept.stamps.prefix}
        lasts = await self.index.attempts_progress([
            (*key, stamps[key].last) for key, kept in by_last.items()
            if stamps[key].last_stamp is None
            or stamps[key].last_stamp != kept.stamps.last_stamp])
        whole = {(j.namespace, j.job): j for j in await self.index.jobs_progress([
            (*key, given[key][0]) for key in changed if key in stamps and key not in by_last])}
        self.read_attempts += len(lasts) + sum(len(j.attempts) for j in whole.values())

        def build() -> list[ett.JobSplit]:
            out = []
            for key, (seen, cs) in given.items():
                done: ett.JobSplit | None = None
                if key in same:
                    done = self._reuse(key, same[key], cs, now)
                elif key in by_last:
                    kept = by_last[key]
                    last = lasts.get((*key, stamps[key].last), kept.last)
                    done = self._join(key, seen, cs, stamps[key], kept.before, last, now)
                elif (job := whole.get(key)) is not None and job.attempts:
                    before = ett.prefix(list(job.attempts[:-1]), cs)
                    done = self._join(key, seen, cs, stamps[key], before, job.attempts[-1],
                                      now)
                if done is not None:
                    out.append(done)
            return out

        return await to_thread.run_sync(build)

    def _join(self, key: Key, seen: float, compile_s: dict[int, float], stamps: JobStamps,
              before: ett.Prefix, last: AttemptProgress, now: float) -> ett.JobSplit:
        done = ett.join(JobProgress(*key, seen, ()), before, last, compile_s, now)
        self._keep(key, _Kept(seen, _key(compile_s), stamps, before, last, done, now))
        return done

    def _reuse(self, key: Key, kept: _Kept, compile_s: dict[int, float],
               now: float) -> ett.JobSplit:
        """An unchanged job's kept split (a live one joined again after LIVE_CACHE_S)."""
        if kept.split.live and now - kept.split_at >= LIVE_CACHE_S:
            kept.split = ett.join(JobProgress(*key, kept.last_seen, ()), kept.before,
                                  kept.last, compile_s, now)
            kept.split_at = now
        with self._mutex:
            if key in self._kept:
                self._kept.move_to_end(key)
                kept.read_at = time.monotonic()
        return kept.split

    def _keep(self, key: Key, kept: _Kept) -> None:
        with self._mutex:
            old = self._kept.pop(key, None)
            if old is not None:
                self._drop(old)
            kept.size = kept_bytes(kept.stamps.attempts, len(kept.split.segments))
            kept.read_at = time.monotonic()
            self.held += kept.stamps.attempts
            self.held_bytes += kept.size
            self._kept[key] = kept
            idle = kept.read_at - RECENT_S
            while self._over() and len(self._kept) > 1:
                first = next(iter(self._kept.values()))
                if first.read_at > idle and first is not kept:  # in use: keep no new one
                    self._kept.pop(key)
                    self._drop(kept)
                    break
                self._kept.popitem(last=False)
                self._drop(first)

    def _over(self) -> bool:
        return self.held > self.max_attempts or self.held_bytes > self.max_bytes

    def _drop(self, gone: _Kept) -> None:
        self.held -= gone.stamps.attempts
        self.held_bytes -= gone.size


def kept_bytes(attempts: int, segments: int) -> int:
    """What a kept job of `attempts` attempts and `segments` segments takes (measured:
    `JOB_BYTES`, `ATTEMPT_BYTES`, `SEGMENT_BYTES`)."""
    return JOB_BYTES + ATTEMPT_BYTES * attempts + SEGMENT_BYTES * segments


def _key(compile_s: dict[int, float]) -> tuple[tuple[int, float], ...]:
    return tuple(sorted(compile_s.items()))
