"""Heartbeats coalesced in memory, written to the index once a flush interval.

At fleet scale nearly every progress batch is one heartbeat (10,000 jobs at a 30 s period
are 333 a second), and each was an index write transaction on the cache's hot path. Here a
batch of heartbeats only is folded into a per-process buffer keyed by (namespace, job,
attempt), keeping what the index's fold rule would keep of them (`progress.beats_kept`: the
least and greatest heartbeat), and the whole buffer is written every `flush_s`
(`MEGACACHE_PROGRESS_FLUSH_S`) in ONE transaction (SQLite) or pipeline (Redis)
(`ProgressStore.add_progress_many`), and at shutdown. A batch holding any other kind of
record is written through at once, with its attempt's buffered heartbeats in it. The
buffer holds at most `max_entries` attempts; a batch that would pass that flushes it first.

Reads: this process's reads of a job flush that job's pending heartbeats first (`flush_job`),
and reads over many jobs flush the buffer, so one process always sees what it was sent;
other workers and replicas see it within `flush_s`. A clean stop (SIGTERM) flushes; a
killed process loses at most `flush_s` of heartbeats, which the split already tolerates (a
heartbeat interval's error in unsaved training time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio

from megacache_client.wire.progress import ProgressRecord
from megacache_server.store.index.base import ProgressStore
from megacache_server.store.index.progress import Fold, beats_kept

log = logging.getLogger("megacache.progress")
Key = tuple[str, str, int]


@dataclass
class _Pending:
    model: str | None
    records: list[ProgressRecord]
    now: float
    count: int

    def add(self, model: str | None, records: list[ProgressRecord], now: float,
            count: int) -> None:
        self.model = model or self.model
        self.records = beats_kept(self.records + records)
        self.now = max(self.now, now)
        self.count += count


class Beats:
    """The buffer of one server process (`flush_s` 0: every batch written through)."""

    def __init__(self, index: ProgressStore, flush_s: float, max_entries: int,
                 namespace_attempts: int | None = None) -> None:
        self.index = index
        self.namespace_attempts = namespace_attempts
        """Each namespace's progress budget (attempts kept), handed to the index."""
        self.flush_s = flush_s
        self.max_entries = max(1, max_entries)
        self.pending: dict[Key, _Pending] = {}
        self.flushes = 0
        self._writing = anyio.Lock()
        """Held while buffered heartbeats are written: a read that flushed its job waits for
        a flush already under way, so what it reads has them."""

    async def add(self, namespace: str, job: str, attempt: int, model: str | None,
                  records: list[ProgressRecord], now: float) -> None:
        key = (namespace, job, attempt)
        if self.flush_s <= 0 or any(r.kind != "heartbeat" for r in records):
            held = self.pending.pop(key, None)
            count = len(records)
            if held is not None:  # its heartbeats go with it: nothing folds in out of order
                model, records = model or held.model, held.records + records
                count += held.count
            try:
                await self.index.add_progress_many(
                    [Fold(namespace, job, attempt, model, records, now, count)],
                    namespace_attempts=self.namespace_attempts)
            except BaseException:
                if held is not None:
                    self._keep(key, held.model, held.records, held.now, held.count)
                raise
            return
        if key not in self.pending and len(self.pending) >= self.max_entries:
            await self.flush()  # bounded: a flood of new attempts flushes early
        self._keep(key, model, beats_kept(records), now, len(records))

    def _keep(self, key: Key, model: str | None, records: list[ProgressRecord], now: float,
              count: int) -> None:
        held = self.pending.get(key)
        if held is None:
            self.pending[key] = _Pending(model, records, now, count)
        else:
            held.add(model, records, now, count)

    async def flush(self) -> int:
        """Write every buffered attempt in one index call; how many."""
        async with self._writing:
            taken, self.pending = self.pending, {}
            await self._write(taken)
            return len(taken)

    async def flush_job(self, namespace: str, job: str) -> None:
        """Write the job's buffered heartbeats (and wait for a flush under way)."""
        async with self._writing:
            taken = {k: self.pending.pop(k) for k in
                     [k for k in self.pending if k[0] == namespace and k[1] == job]}
            await self._write(taken)

    async def _write(self, taken: dict[Key, _Pending]) -> None:
        if not taken:
            return
        try:
            await self.index.add_progress_many([
                Fold(ns, job, attempt, p.model, p.records, p.now, p.count)
                for (ns, job, attempt), p in taken.items()],
                namespace_attempts=self.namespace_attempts)
            self.flushes += 1
        except BaseException:
            for key, p in taken.items():  # kept for the next flush, folded with newer beats
                self._keep(key, p.model, p.records, p.now, p.count)
            raise

    async def run_forever(self) -> None:
        """Flush every `flush_s` until cancelled (then the lifespan's `flush` writes the
        rest)."""
        while True:
            await anyio.sleep(self.flush_s)
            try:
                await self.flush()
            except Exception:  # the index down: kept, tried again next time
                log.warning("writing buffered heartbeats failed; kept for the next flush",
                            exc_info=True)
