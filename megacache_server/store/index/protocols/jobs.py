"""Jobs and claims: one resolution of a key per job attempt, and one publisher per key
across a fleet (a lease); the limits every backend applies to both."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from megacache_server.errors import InsufficientStorage
from megacache_server.store.index.protocols.entries import StoredEntry


def records_full(namespace: str, cap: int) -> InsufficientStorage:
    """The refusal of a resolution or claim that would pass its namespace's cap of live
    job records (`JobStore.resolve`, `ClaimStore.claim`), the same on every backend."""
    return InsufficientStorage(
        f"namespace {namespace!r} holds {cap} live job resolutions and publish claims, its "
        "limit: new ones are refused until some expire (MEGACACHE_NAMESPACE_JOB_RECORDS)",
        code="job_records_quota", limit=cap)


MAX_RESOLUTION_TTL_S = 24 * 3600.0
"""The longest a resolution lives without a rank asking again (a day)."""
MAX_CLAIM_LEASE_S = 15 * 60.0
"""The longest a publish claim lasts unrenewed: a claimant that dies blocks others this long."""


@dataclass(frozen=True)
class Resolution:
    """What one job attempt resolved a key to, fixed by its first rank: the entry as it was
    then (manifest bytes, ETag, the namespace that wrote it, its blobs), or a miss."""

    namespace: str  # the job's namespace (the caller's), not necessarily the entry's
    job: str
    attempt: int
    key: str
    manifest_json: bytes  # b"": a miss
    etag: str
    entry_namespace: str
    digests: tuple[str, ...]
    resolved_at: float
    expires_at: float

    @property
    def hit(self) -> bool:
        return bool(self.manifest_json)


@dataclass(frozen=True)
class Claim:
    """A publish claim as it stands after a claim call: `granted` when `holder` is the caller."""

    granted: bool
    holder: str
    expires_at: float


class JobStore(ABC):
    """One resolution of a fingerprint key per (namespace, job, attempt), fixed by the first
    rank that asks and held (with its blobs, against GC) while ranks keep asking."""

    @abstractmethod
    async def resolve(self, namespace: str, job: str, attempt: int, key: str,
                      candidate: StoredEntry | None, ttl_s: float, now: float, *,
                      max_records: int | None = None) -> Resolution:
        """The resolution of `key` for this job attempt: the live one if there is one (its
        life renewed to at least `now + ttl_s / 2`, never shortened), else `candidate` (an
        entry, or None for a miss) recorded atomically, alive until `now + ttl_s`. Every
        caller gets the same answer until it expires, across processes and replicas; while
        it lives, its blobs are held (`held_blobs`). `ttl_s` is clamped to
        MAX_RESOLUTION_TTL_S. A new record is refused (`records_full`, nothing written)
        when the namespace already holds `max_records` live resolutions and claims
        together: a record holds a manifest's bytes for up to a day, and a read token can
        make up job ids."""

    @abstractmethod
    async def held_blobs(self, digests: list[str], now: float) -> set[str]:
        """Which of `digests` a resolution alive at `now` names: GC never deletes them."""

    @abstractmethod
    async def prune_jobs(self, now: float) -> int:
        """Drop resolutions and claims expired before `now` (and the holds of their blobs);
        how many went. Backends whose records expire on their own may return 0."""


class ClaimStore(ABC):
    """Publish claims, a lease per (namespace, key): one uploader across a fleet."""

    @abstractmethod
    async def claim(self, namespace: str, key: str, holder: str, lease_s: float,
                    now: float, *, max_records: int | None = None) -> Claim:
        """Claim the publish of `key`: granted (until `now + lease_s`) when nobody holds a
        live claim or `holder` already does (a renewal); else the current holder and when
        its lease runs out. An expired lease is taken over. Atomic across replicas;
        `lease_s` is clamped to MAX_CLAIM_LEASE_S. A claim where none is live counts on
        the namespace's `max_records`, as a resolution does (`records_full`)."""

    @abstractmethod
    async def release(self, namespace: str, key: str, holder: str, now: float) -> bool:
        """Give up `holder`'s claim. False when another holder's live claim stands (it is
        left alone); True otherwise (released, or there was nothing live to release)."""


def clamp_ttl(ttl_s: float, limit: float) -> float:
    """A lifetime within (0, limit]: what every backend stores, whatever it is asked."""
    if math.isnan(ttl_s) or ttl_s <= 0:  # NaN or not positive: the shortest meaningful
        return 1.0
    return min(float(ttl_s), limit)
