"""The index: every storage protocol at once (`Index`), with the calls that span them and
its lifecycle. The protocols themselves live one per role in `protocols/` (entries, blobs,
quotas, tokens, events, rates, locks, jobs, trust, progress); a backend (`sqlite/`,
`redis/`) implements each in a module of the same name and `Index` as the class made of them.
Only the cache service (`megacache_server.service`) calls these: routes never do.

The protocols' names are re-exported here: the service and the tests import them from one
place, whichever role they belong to.
"""

from __future__ import annotations

from abc import abstractmethod

from megacache_server.store.index.protocols.blobs import BlobLedger, BlobRecord
from megacache_server.store.index.protocols.entries import (
    EntryInfo,
    EntryStore,
    NewEntry,
    Precondition,
    StoredEntry,
    canonical,
    check_precondition,
    entry_etag,
    sequenced,
)
from megacache_server.store.index.protocols.ett_rollups import EttRollupStore
from megacache_server.store.index.protocols.events import (
    MAX_VIEW_ATTEMPTS,
    AttemptRecord,
    EventLog,
    JobView,
    MissReason,
    ModelStats,
    TimelineSlot,
)
from megacache_server.store.index.protocols.jobs import (
    MAX_CLAIM_LEASE_S,
    MAX_RESOLUTION_TTL_S,
    Claim,
    ClaimStore,
    JobStore,
    Resolution,
    clamp_ttl,
    records_full,
)
from megacache_server.store.index.protocols.locks import LockStore
from megacache_server.store.index.protocols.progress import ProgressStore
from megacache_server.store.index.protocols.quotas import PendingHold, QuotaStore
from megacache_server.store.index.protocols.rates import RateStore, refill
from megacache_server.store.index.protocols.tokens import TokenRecord, TokenStore
from megacache_server.store.index.protocols.trust import (
    MAX_QUARANTINE_RECORDS,
    QuarantineRecord,
    TrustStore,
)

__all__ = [
    "MAX_CLAIM_LEASE_S", "MAX_QUARANTINE_RECORDS", "MAX_RESOLUTION_TTL_S", "MAX_VIEW_ATTEMPTS",
    "AttemptRecord", "BlobLedger", "BlobRecord", "Claim", "ClaimStore", "EntryInfo",
    "EntryStore", "EttRollupStore", "EventLog", "Index", "JobStore", "JobView", "LockStore",
    "MissReason",
    "ModelStats", "NewEntry", "PendingHold", "Precondition", "ProgressStore", "QuarantineRecord",
    "QuotaStore", "RateStore", "Resolution", "StoredEntry", "TimelineSlot", "TokenRecord",
    "TokenStore", "TrustStore", "canonical", "check_precondition", "clamp_ttl", "entry_etag",
    "records_full", "refill", "sequenced",
]


class Index(EntryStore, BlobLedger, QuotaStore, TokenStore, EventLog, RateStore, LockStore,
            JobStore, ClaimStore, TrustStore, ProgressStore, EttRollupStore):
    """Every protocol of `protocols/`, with the calls that span them and the index's lifecycle."""

    name: str = "abstract"

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect or create schema; called once at app start."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; called once at app stop."""

    @abstractmethod
    async def ping(self, *, write: bool = False) -> None:
        """Raise if the index cannot serve requests; `write` also proves it can still write."""

    async def eviction_facts(self, digests: list[str], now: float
                             ) -> dict[str, tuple[int, int | None]]:
        """What eviction must know of each of `digests`: its names (the entries naming
        it, plus one when a live job resolution holds it) and its recorded size (None when
        the index has no record). From three reads; a backend that can answer in one round
        trip per batch overrides it (GC asks this of every blob the entries it evicts name).
        """
        names = await self.reference_counts(digests)
        for digest in await self.held_blobs(digests, now):
            names[digest] = names.get(digest, 0) + 1
        records = await self.blob_records_of(digests)
        return {d: (names.get(d, 0), rec.size if (rec := records.get(d)) else None)
                for d in digests}
