"""Eviction and garbage collection, the same on every index and blob store.

Rules, in order:
1. Over the store budget, entries go least-recently-used first until the blobs they alone
   referenced bring the store under the low-water mark, counting only bytes that really go
   now. Pinned entries never go, and neither does an entry whose eviction frees no blob.
2. A blob no entry names is deleted once it has not been touched for the grace period:
   an upload followed a moment later by the manifest naming it is never collected in
   between (writing a manifest touches its blobs before checking them).
3. Right before a blob is deleted, its references and last touch are read again, so a
   manifest written while the plan was made keeps its blobs.

`plan()` only reads, from the index's columns (never a manifest), and does its arithmetic in
a worker thread so a plan over a million entries does not stall the event loop; `apply()`
acts on a plan. Callers take the GC lock: `Cache.collect` in `megacache_server.cache`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from anyio import to_thread

from megacache_server.index.base import BlobRecord, EntryInfo
from megacache_server.storage import Storage


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

    @property
    def freed_bytes(self) -> int:
        return sum(d.size for d in self.delete)


@dataclass
class GcResult:
    evicted: int = 0
    deleted: int = 0
    freed_bytes: int = 0
    spared: int = 0  # blobs re-referenced or touched between plan and delete


async def plan(storage: Storage, *, budget: int | None, grace_s: float,
               low_water: float = 0.9, now: float | None = None) -> GcPlan:
    now = time.time() if now is None else now
    records = await storage.index.blob_records()
    entries = await storage.index.entry_infos()
    return await to_thread.run_sync(lambda: decide(records, entries, budget=budget,
                                                   grace_s=grace_s, low_water=low_water,
                                                   now=now))


def decide(records_list: list[BlobRecord], entries: list[EntryInfo], *, budget: int | None,
           grace_s: float, low_water: float, now: float) -> GcPlan:
    """The plan itself: pure arithmetic over what the index holds."""
    records = {b.digest: b for b in records_list}
    stored = sum(b.size for b in records_list)
    target = int(budget * low_water) if budget is not None else None
    result = GcPlan(stored_bytes=stored, budget=budget, target_bytes=target)
    refcount: dict[str, int] = {}
    for entry in entries:
        for digest in set(entry.digests):
            refcount[digest] = refcount.get(digest, 0) + 1

    # Blobs no entry names, out of their grace period: going anyway, whatever eviction does.
    idle = {d for d, rec in records.items()
            if refcount.get(d, 0) == 0 and rec.touched_at < now - grace_s}
    projected = stored - sum(records[d].size for d in idle)
    freed_by_eviction: set[str] = set()
    if budget is not None and target is not None and stored > budget:
        lru = sorted((e for e in entries if not e.pinned), key=lambda e: (e.last_access, e.key))
        freed_by_eviction = _evict_lru(result, lru, refcount, records, projected=projected,
                                       target=target)

    for digest, rec in sorted(records.items()):
        if digest in freed_by_eviction:
            # The grace period shields fresh uploads no manifest names yet; these were named
            # until this plan, so only a touch from now on (a new manifest) spares them.
            result.delete.append(Deletion(digest, rec.size, "named only by evicted entries",
                                          touched_before=now))
        elif digest in idle:
            result.delete.append(Deletion(digest, rec.size, "no entry names it",
                                          touched_before=now - grace_s))
        elif refcount.get(digest, 0) == 0:
            result.kept_in_grace += 1
    return result


def _evict_lru(result: GcPlan, lru: list[EntryInfo], refcount: dict[str, int],
               records: dict[str, BlobRecord], *, projected: int, target: int) -> set[str]:
    """Pick least-recently-used entries until the bytes they really free reach `target`.

    A blob is freed only when every entry naming it goes. Entries are taken in LRU order
    while the projection is above target; afterwards, any taken entry that names no freed
    blob (all its blobs are still named by entries that stay, pinned ones included) is put
    back: evicting it would lose a cache entry and free nothing. Returns the freed blobs.
    """
    taken: list[EntryInfo] = []
    freed: set[str] = set()
    for entry in lru:
        if projected <= target:
            break
        taken.append(entry)
        for digest in set(entry.digests):
            refcount[digest] -= 1
            if refcount[digest] == 0 and digest in records:
                freed.add(digest)
                projected -= records[digest].size
    for entry in taken:
        if set(entry.digests) & freed:
            when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(entry.last_access))
            result.evict.append((entry.key, f"least recently used (last access {when} UTC)"))
        else:
            for digest in set(entry.digests):
                refcount[digest] += 1
    return freed


async def apply(storage: Storage, gc_plan: GcPlan) -> GcResult:
    """Act on a plan, re-checking each entry and blob as it goes (the plan may be stale)."""
    result = GcResult()
    for key, _ in gc_plan.evict:
        entry = await storage.index.get(key, touch=False)
        if entry is not None and entry.pinned:
            continue  # pinned since the plan was made
        if await storage.index.delete(key):
            result.evicted += 1
    for deletion in gc_plan.delete:
        if await _still_collectable(storage, deletion):
            await storage.blobs.delete(deletion.digest)
            await storage.index.forget_blob(deletion.digest)
            result.deleted += 1
            result.freed_bytes += deletion.size
        else:
            result.spared += 1
    return result


async def _still_collectable(storage: Storage, deletion: Deletion) -> bool:
    if await storage.index.referenced([deletion.digest]):
        return False
    rec = await storage.index.blob_record(deletion.digest)
    return rec is not None and rec.touched_at < deletion.touched_before
