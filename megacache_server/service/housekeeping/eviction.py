"""Eviction and garbage collection, the same on every index and blob store.

Rules, in order:
1. Over the store budget, entries go least-recently-used first until the blobs they alone
   referenced bring the store under the low-water mark, counting only bytes that really go
   now. Pinned entries never go, and neither does an entry whose eviction frees no blob.
2. A blob no entry names is deleted once it has not been touched for the grace period:
   an upload followed a moment later by the manifest naming it is never collected in
   between (a manifest that passed its checks touches its blobs, then reads their records
   again: one collected in between fails the write; a refused manifest touches nothing).
3. A blob a live job resolution names (`JobStore.held_blobs`) stays, referenced or not: the
   ranks of that job attempt were promised the entry as it was when their first rank asked.
   An entry whose blobs are all held, or named by others, frees nothing and is not evicted.
4. Right before a blob is deleted, its references, holds and last touch are read again, so a
   manifest written (or a resolution made) while the plan was made keeps its blobs.

`plan()` only reads, from the index's columns (never a manifest), page by page, so a
plan over a million entries neither holds them all in memory nor stalls the event loop;
`apply()` acts on a plan, in batches. Callers take the GC lock: `LocalCollector` in
`megacache_server.service.housekeeping.collector`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from anyio import to_thread

from megacache_server.store.index.base import BlobRecord, EntryInfo, Index
from megacache_server.store.storage import Storage


class Deletion(NamedTuple):
    """A blob the plan deletes, and the touch time after which it must be spared."""

    digest: str
    size: int
    why: str
    touched_before: float  # a touch at or after this (a manifest naming it) spares the blob


@dataclass
class GcPlan:
    stored_bytes: int
    budget: int | None
    target_bytes: int | None
    evict: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    delete: list[Deletion] = field(default_factory=list)
    kept_in_grace: int = 0
    kept_held: int = 0  # unreferenced blobs out of grace that a live job resolution names

    @property
    def freed_bytes(self) -> int:
        return sum(d.size for d in self.delete)


@dataclass
class GcResult:
    evicted: int = 0
    deleted: int = 0
    freed_bytes: int = 0
    spared: int = 0  # blobs re-referenced or touched between plan and delete
    failed: int = 0  # blobs the store could not delete: kept on record, tried again next GC


PAGE = 2000
"""LRU entries read per page while eviction looks for enough bytes to free."""
RECHECK = 64
"""Blobs re-checked together right before they are deleted: small, so a manifest written
between the check and the delete (it touches its blobs, then reads their records again)
has little time to fall in."""


async def plan(storage: Storage, *, budget: int | None, grace_s: float,
               low_water: float = 0.9, now: float | None = None) -> GcPlan:
    """Read-only. Its cost follows what goes, not the store: the unreferenced blobs (one
    paged scan of the ledger in the index, never a manifest), and only as many LRU entries
    as eviction needs, with the reference counts of just their blobs."""
    now = time.time() if now is None else now
    index = storage.index
    stored = await index.stored_bytes()
    target = int(budget * low_water) if budget is not None else None
    result = GcPlan(stored_bytes=stored, budget=budget, target_bytes=target)
    # Blobs no entry names, out of their grace period: going anyway, whatever eviction does.
    idle: list[BlobRecord] = []
    unreferenced = await index.unreferenced_blobs()
    held = await index.held_blobs([r.digest for r in unreferenced
                                   if r.touched_at < now - grace_s], now)
    for rec in unreferenced:
        if rec.touched_at >= now - grace_s:
            result.kept_in_grace += 1
        elif rec.digest in held:
            result.kept_held += 1
        else:
            idle.append(rec)
    projected = stored - sum(rec.size for rec in idle)
    taken: list[EntryInfo] = []
    freed: dict[str, int] = {}
    if budget is not None and target is not None and stored > budget and projected > target:
        taken, freed = await _Lru(index, now).evict_until(projected, target)
    # Lists of a hundred thousand items are built off the event loop.
    await to_thread.run_sync(_conclude, result, taken, freed, idle, now, grace_s)
    return result


def _conclude(result: GcPlan, taken: list[EntryInfo], freed: dict[str, int],
              idle: list[BlobRecord], now: float, grace_s: float) -> None:
    """The plan's lists: entries that free a blob (others taken are put back), then blobs."""
    for entry in taken:
        if not freed.keys().isdisjoint(entry.digests):
            when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(entry.last_access))
            result.evict.append((entry.key, f"least recently used (last access {when} UTC)"))
    # The grace period shields fresh uploads no manifest names yet; these were named until
    # this plan, so only a touch from now on (a new manifest) spares them.
    result.delete += [Deletion(digest, size, "named only by evicted entries", touched_before=now)
                      for digest, size in sorted(freed.items())]
    result.delete += [Deletion(rec.digest, rec.size, "no entry names it",
                               touched_before=now - grace_s) for rec in idle]


class _Lru:
    """Least-recently-used entries taken page by page until the bytes they free reach the
    target. A blob is freed only when every entry naming it goes (pinned entries count as
    naming it) and no live job resolution holds it (a hold counts as one more name).
    Entries taken that free no blob (all their blobs still named by entries that stay, or
    held) are put back: evicting one would lose a cache entry and free nothing."""

    def __init__(self, index: Index, now: float) -> None:
        self.index = index
        self.now = now
        self.refcount: dict[str, int] = {}
        self.sizes: dict[str, int] = {}

    async def evict_until(self, projected: int, target: int
                          ) -> tuple[list[EntryInfo], dict[str, int]]:
        """(entries taken in LRU order, blobs their eviction frees -> size)."""
        taken: list[EntryInfo] = []
        freed: dict[str, int] = {}
        last: EntryInfo | None = None
        while projected > target:
            page = await self.index.lru_entries(PAGE, after=last)
            if not page:
                break
            last = page[-1]
            await self._learn({d for e in page for d in e.digests})
            for entry in page:
                if projected <= target:
                    break
                taken.append(entry)
                for digest in set(entry.digests):
                    self.refcount[digest] -= 1
                    if self.refcount[digest] == 0 and digest in self.sizes:
                        freed[digest] = self.sizes[digest]
                        projected -= self.sizes[digest]
        return taken, freed

    async def _learn(self, digests: set[str]) -> None:
        """Reference counts (holds included) and sizes of blobs first met on this page."""
        new = sorted(digests - self.refcount.keys())
        for digest, (names, size) in (await self.index.eviction_facts(new, self.now)).items():
            self.refcount[digest] = names
            if size is not None:
                self.sizes[digest] = size


async def apply(storage: Storage, gc_plan: GcPlan) -> GcResult:
    """Act on a plan, re-checking each entry and blob as it goes (the plan may be stale):
    entries go in batches (an entry pinned since the plan stays), then each blob whose
    references, holds and last touch still allow it."""
    result = GcResult()
    index = storage.index
    result.evicted = await index.delete_unpinned([key for key, _ in gc_plan.evict])
    for i in range(0, len(gc_plan.delete), RECHECK):
        part = gc_plan.delete[i:i + RECHECK]
        digests = [d.digest for d in part]
        named = await index.referenced(digests)
        named |= await index.held_blobs(digests, time.time())
        records = await index.blob_records_of(digests)
        going: list[Deletion] = []
        for deletion in part:
            rec = records.get(deletion.digest)
            if deletion.digest in named or rec is None or \
                    rec.touched_at >= deletion.touched_before:
                result.spared += 1
            else:
                going.append(deletion)
        failed = await storage.blobs.delete_many([d.digest for d in going])
        gone = [d for d in going if d.digest not in failed]
        await index.forget_blobs([d.digest for d in gone])
        result.failed += len(going) - len(gone)
        result.deleted += len(gone)
        result.freed_bytes += sum(d.size for d in gone)
    return result
