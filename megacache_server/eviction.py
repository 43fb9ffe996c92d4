"""Eviction and garbage collection, the same on every index and blob store.

Rules, in order:
1. Over the store budget, entries go least-recently-used first until the blobs they alone
   referenced bring the store under the low-water mark. Pinned entries never go.
2. A blob no entry names is deleted once it has not been touched for the grace period:
   an upload followed a moment later by the manifest naming it is never collected in
   between (writing a manifest touches its blobs before checking them).
3. Right before a blob is deleted, its references and last touch are read again, so a
   manifest written while the plan was made keeps its blobs.

`plan()` only reads; `apply()` acts on a plan. `megacache-server gc --dry-run` prints a
plan without applying it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megacache_client.manifest import Manifest
from megacache_server.observe import EVICTIONS
from megacache_server.storage import Storage

ALL = 10**9


@dataclass
class GcPlan:
    stored_bytes: int
    budget: int | None
    target_bytes: int | None
    evict: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    delete: list[tuple[str, int, str]] = field(default_factory=list)  # (digest, size, why)
    kept_in_grace: int = 0

    @property
    def freed_bytes(self) -> int:
        return sum(size for _, size, _ in self.delete)


@dataclass
class GcResult:
    evicted: int = 0
    deleted: int = 0
    freed_bytes: int = 0
    spared: int = 0  # blobs re-referenced or touched between plan and delete


async def plan(storage: Storage, *, budget: int | None, grace_s: float,
               low_water: float = 0.9, now: float | None = None) -> GcPlan:
    now = time.time() if now is None else now
    records = {b.digest: b for b in await storage.index.blob_records()}
    stored = sum(b.size for b in records.values())
    target = int(budget * low_water) if budget is not None else None
    result = GcPlan(stored_bytes=stored, budget=budget, target_bytes=target)

    everything = await storage.index.list_entries(model=None, env_digest=None, hw_digest=None,
                                                  limit=ALL)
    names = {e.key: _digests(e.manifest_json) for e in everything}
    refcount: dict[str, int] = {}
    for digests in names.values():
        for digest in digests:
            refcount[digest] = refcount.get(digest, 0) + 1

    def collectable(digest: str) -> bool:
        rec = records.get(digest)
        return rec is not None and refcount.get(digest, 0) == 0 and rec.touched_at < now - grace_s

    projected = stored - sum(records[d].size for d in records if collectable(d))
    if budget is not None and stored > budget:
        for entry in await storage.index.lru_entries(ALL):
            if projected <= (target or 0):
                break
            when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(entry.last_access))
            result.evict.append((entry.key, f"least recently used (last access {when} UTC)"))
            for digest in names.get(entry.key, []):
                refcount[digest] -= 1
                if refcount[digest] == 0 and collectable(digest):
                    projected -= records[digest].size

    freed_by_eviction = {d for k, _ in result.evict for d in names.get(k, [])}
    for digest, rec in sorted(records.items()):
        if refcount.get(digest, 0) > 0:
            continue
        if rec.touched_at >= now - grace_s:
            result.kept_in_grace += 1
            continue
        why = "named only by evicted entries" if digest in freed_by_eviction \
            else "no entry names it"
        result.delete.append((digest, rec.size, why))
    return result


async def apply(storage: Storage, gc_plan: GcPlan, *, grace_s: float) -> GcResult:
    result = GcResult()
    for key, _ in gc_plan.evict:
        entry = await storage.index.get(key, touch=False)
        if entry is not None and entry.pinned:
            continue  # pinned since the plan was made
        if await storage.index.delete(key):
            result.evicted += 1
            EVICTIONS.labels("entry").inc()
    for digest, size, _ in gc_plan.delete:
        if await _still_collectable(storage, digest, grace_s):
            await storage.blobs.delete(digest)
            await storage.index.forget_blob(digest)
            result.deleted += 1
            result.freed_bytes += size
            EVICTIONS.labels("blob").inc()
        else:
            result.spared += 1
    return result


async def collect(storage: Storage, *, budget: int | None, grace_s: float,
                  low_water: float = 0.9) -> GcResult:
    """Plan and apply in one go (the server's background task and its budget check)."""
    gc_plan = await plan(storage, budget=budget, grace_s=grace_s, low_water=low_water)
    if not gc_plan.evict and not gc_plan.delete:
        return GcResult()
    return await apply(storage, gc_plan, grace_s=grace_s)


async def _still_collectable(storage: Storage, digest: str, grace_s: float) -> bool:
    if await storage.index.referenced([digest]):
        return False
    rec = await storage.index.blob_record(digest)
    return rec is not None and rec.touched_at < time.time() - grace_s


def _digests(manifest_json: bytes) -> list[str]:
    return [b.digest for b in Manifest.model_validate_json(manifest_json).blobs]
