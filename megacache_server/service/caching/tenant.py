"""The cache as one caller sees it: `TenantCache`, the one object a route calls.

Routes translate HTTP to calls on a `TenantCache` and back, and know nothing of how it is
made. `BoundCache` makes one from the cache's parts (each in its own module, owning its
rules and documenting them) and the caller's principal, which decides what the caller may
see (`auth.Principal`); in the server each is wrapped in `metered.MeteredTenantCache`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from megacache_server.service.caching.blobs import Blobs
from megacache_server.service.caching.entries import Entries, EntryWrite
from megacache_server.service.caching.resolutions import (
    DEFAULT_CLAIM_LEASE_S,
    DEFAULT_RESOLUTION_TTL_S,
    FallbackRule,
    Resolutions,
)
from megacache_server.service.ett.beats import Beats
from megacache_server.service.ett.intake import ProgressIntake
from megacache_server.service.housekeeping.collector import Collector
from megacache_server.service.limits.quotas import Quotas
from megacache_server.service.limits.views import Views
from megacache_server.service.observability.events import EventIntake, EventReader, Figures
from megacache_server.service.security.auth import Principal
from megacache_server.service.security.provenance import ProducerClaims
from megacache_server.service.security.quarantine import Quarantine
from megacache_server.settings import Settings
from megacache_server.store.index.base import Claim, Precondition, Resolution, StoredEntry
from megacache_server.store.storage import Storage

__all__ = ["BoundCache", "Parts", "Precondition", "StoredEntry", "TenantCache"]


class TenantCache(Protocol):
    """Every call a route makes, as one caller. Each is the method of the same name on the
    part that owns it (`Blobs`, `Entries`, `Resolutions`, `Quarantine`, `EventIntake`,
    `EventReader`, `ProgressIntake`),
    where its rules are documented, with the caller's principal added."""

    @property
    def settings(self) -> Settings: ...
    @property
    def principal(self) -> Principal: ...

    async def put_blob(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool: ...
    async def blob_size(self, digest: str) -> int | None: ...
    async def recorded_blob_size(self, digest: str) -> int | None: ...
    def read_blob(self, digest: str, start: int, end: int) -> AsyncIterator[bytes]: ...
    def presigned_url(self, digest: str) -> str | None: ...

    async def put_entry(self, key: str, body: bytes, condition: Precondition, *,
                        claims: ProducerClaims | None = None) -> EntryWrite: ...
    async def get_entry(self, key: str, *, touch: bool = True) -> StoredEntry: ...
    async def list_entries(self, *, namespace: str | None, model: str | None,
                           env: str | None, hw: str | None, limit: int,
                           writers: str | None = None) -> list[StoredEntry]: ...
    async def delete_entry(self, key: str) -> None: ...
    async def set_pinned(self, key: str, pinned: bool) -> None: ...

    async def resolve(self, key: str, *, job: str, attempt: int,
                      ttl_s: float = DEFAULT_RESOLUTION_TTL_S,
                      fallback: FallbackRule | None = None) -> Resolution: ...
    async def resolution_provenance(self, done: Resolution) -> str: ...
    async def claim(self, key: str, *, holder: str,
                    lease_s: float = DEFAULT_CLAIM_LEASE_S) -> Claim: ...
    async def release_claim(self, key: str, *, holder: str) -> None: ...

    async def report_blob(self, digest: str, *, kind: str, entry_key: str | None,
                          detail: str) -> dict[str, Any]: ...
    async def report_entry(self, key: str, *, kind: str, detail: str,
                           job: str | None) -> dict[str, Any]: ...
    async def quarantines(self, *, limit: int = 100) -> list[dict[str, Any]]: ...

    async def add_event(self, body: bytes) -> None: ...
    async def add_progress(self, job: str, body: bytes) -> int: ...
    async def job_ett(self, job: str, *, since_s: float | None = None) -> dict[str, Any]: ...
    async def stats(self, *, since: float | None) -> dict[str, Any]: ...
    async def ett_trend(self, *, days: float, period: str,
                        model: str | None = None) -> dict[str, Any]: ...
    async def jobs(self, *, limit: int) -> list[dict[str, Any]]: ...
    async def dashboard(self, *, hours: float) -> dict[str, Any]: ...
    async def figures(self) -> Figures: ...
    def viewing(self) -> AbstractAsyncContextManager[None]:
        """Held while a view is made: the caller's view budget (`service.limits.views`)."""
        ...


@dataclass(frozen=True)
class Parts:
    """The cache's parts, one of each per process: what every caller's cache is made of.
    Each part reaches the others it needs directly, never through a caller's cache."""

    settings: Settings
    blobs: Blobs
    entries: Entries
    resolutions: Resolutions
    quarantine: Quarantine
    event_intake: EventIntake
    event_reader: EventReader
    progress: ProgressIntake
    views: Views

    @classmethod
    def build(cls, settings: Settings, storage: Storage, collector: Collector) -> Parts:
        quotas = Quotas(settings, storage.index, collector)
        blobs = Blobs(settings, storage, quotas)
        entries = Entries(storage.index, blobs, quotas)
        quarantine = Quarantine(settings, storage, blobs, entries, quotas)
        progress = ProgressIntake(storage.index, quotas, Beats(
            storage.index, settings.progress_flush_s, settings.progress_buffer_entries,
            settings.progress_namespace_attempts))
        return cls(settings, blobs, entries, Resolutions(storage.index, entries, quotas),
                   quarantine, EventIntake(storage.index, quotas),
                   EventReader(settings, storage, quarantine, progress), progress,
                   Views(settings, storage.index, progress.cache.lane))


class BoundCache:
    """A `TenantCache`: the parts, bound to one principal. Made per request; holds nothing
    else."""

    def __init__(self, parts: Parts, principal: Principal) -> None:
        self.parts = parts
        self.settings = parts.settings
        self.principal = principal

    async def put_blob(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool:
        return await self.parts.blobs.put_blob(self.principal, digest, size, body)

    async def blob_size(self, digest: str) -> int | None:
        return await self.parts.blobs.blob_size(self.principal, digest)

    async def recorded_blob_size(self, digest: str) -> int | None:
        return await self.parts.blobs.recorded_blob_size(self.principal, digest)

    def read_blob(self, digest: str, start: int, end: int) -> AsyncIterator[bytes]:
        return self.parts.blobs.read_blob(digest, start, end)

    def presigned_url(self, digest: str) -> str | None:
        return self.parts.blobs.presigned_url(digest)

    async def put_entry(self, key: str, body: bytes, condition: Precondition, *,
                        claims: ProducerClaims | None = None) -> EntryWrite:
        return await self.parts.entries.put_entry(self.principal, key, body, condition,
                                                  claims=claims)

    async def get_entry(self, key: str, *, touch: bool = True) -> StoredEntry:
        return await self.parts.entries.get_entry(self.principal, key, touch=touch)

    async def list_entries(self, *, namespace: str | None, model: str | None,
                           env: str | None, hw: str | None, limit: int,
                           writers: str | None = None) -> list[StoredEntry]:
        return await self.parts.entries.list_entries(
            self.principal, namespace=namespace, model=model, env=env, hw=hw, limit=limit,
            writers=writers)

    async def delete_entry(self, key: str) -> None:
        await self.parts.entries.delete_entry(self.principal, key)

    async def set_pinned(self, key: str, pinned: bool) -> None:
        await self.parts.entries.set_pinned(self.principal, key, pinned)

    async def resolve(self, key: str, *, job: str, attempt: int,
                      ttl_s: float = DEFAULT_RESOLUTION_TTL_S,
                      fallback: FallbackRule | None = None) -> Resolution:
        return await self.parts.resolutions.resolve(self.principal, key, job=job, attempt=attempt,
                                             ttl_s=ttl_s, fallback=fallback)

    async def resolution_provenance(self, done: Resolution) -> str:
        return await self.parts.resolutions.resolution_provenance(done)

    async def claim(self, key: str, *, holder: str,
                    lease_s: float = DEFAULT_CLAIM_LEASE_S) -> Claim:
        return await self.parts.resolutions.claim(self.principal, key, holder=holder,
                                                  lease_s=lease_s)

    async def release_claim(self, key: str, *, holder: str) -> None:
        await self.parts.resolutions.release_claim(self.principal, key, holder=holder)

    async def report_blob(self, digest: str, *, kind: str, entry_key: str | None,
                          detail: str) -> dict[str, Any]:
        return await self.parts.quarantine.report_blob(self.principal, digest, kind=kind,
                                                       entry_key=entry_key, detail=detail)

    async def report_entry(self, key: str, *, kind: str, detail: str,
                           job: str | None) -> dict[str, Any]:
        return await self.parts.quarantine.report_entry(self.principal, key, kind=kind,
                                                        detail=detail, job=job)

    async def quarantines(self, *, limit: int = 100) -> list[dict[str, Any]]:
        return await self.parts.quarantine.quarantines(self.principal, limit=limit)

    async def add_event(self, body: bytes) -> None:
        await self.parts.event_intake.add_event(self.principal, body)

    async def add_progress(self, job: str, body: bytes) -> int:
        return await self.parts.progress.add_progress(self.principal, job, body)

    async def job_ett(self, job: str, *, since_s: float | None = None) -> dict[str, Any]:
        return await self.parts.progress.job_ett(self.principal, job, since_s=since_s)

    async def ett_trend(self, *, days: float, period: str,
                        model: str | None = None) -> dict[str, Any]:
        return await self.parts.progress.trend(self.principal, days=days, period=period,
                                               model=model)

    async def stats(self, *, since: float | None) -> dict[str, Any]:
        return await self.parts.event_reader.stats(self.principal, since=since)

    async def jobs(self, *, limit: int) -> list[dict[str, Any]]:
        return await self.parts.event_reader.jobs(self.principal, limit=limit)

    async def dashboard(self, *, hours: float) -> dict[str, Any]:
        return await self.parts.event_reader.dashboard(self.principal, hours=hours)

    async def figures(self) -> Figures:
        return await self.parts.event_reader.figures(self.principal)

    def viewing(self) -> AbstractAsyncContextManager[None]:
        return self.parts.views.spend(self.principal)
