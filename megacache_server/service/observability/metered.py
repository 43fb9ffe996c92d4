"""Counting what the cache serves, as decorators: the service knows nothing of Prometheus.

As bazel-remote's metrics decorator embeds its cache and overrides only the calls it counts,
`MeteredTenantCache` wraps a `TenantCache` and `MeteredCollector` a `Collector`: a counted
call is the wrapped one's, its result or error counted on the way out; every other call is
handed to the wrapped one unchanged. The parts call each other directly, never through a
caller's cache, so a lookup made to resolve a job or check a report is not a lookup counted.
The server builds its cache with both (`api.app`); the CLI and the GC child count nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

from prometheus_client import Counter

from megacache_server.errors import Conflict, NotFound
from megacache_server.service.caching.entries import EntryWrite
from megacache_server.service.caching.resolutions import (
    DEFAULT_CLAIM_LEASE_S,
    DEFAULT_RESOLUTION_TTL_S,
    FallbackRule,
)
from megacache_server.service.caching.tenant import TenantCache
from megacache_server.service.housekeeping.collector import Collector
from megacache_server.service.housekeeping.eviction import GcResult
from megacache_server.service.observability.events import Figures
from megacache_server.service.security.auth import Principal
from megacache_server.service.security.provenance import ProducerClaims
from megacache_server.settings import Settings
from megacache_server.store.index.base import Claim, Precondition, Resolution, StoredEntry

LOOKUPS = Counter("megacache_lookups_total", "Entry lookups by result", ["result"])
UPLOADED = Counter("megacache_blob_upload_bytes_total", "Blob bytes uploaded")
ENTRY_WRITES = Counter("megacache_entry_writes_total", "Entries written", ["result"])
EVENTS = Counter("megacache_events_total", "Client events by result", ["result"])
RESOLUTIONS = Counter("megacache_job_resolutions_total",
                      "Job-attempt resolutions served, by what they resolved to", ["result"])
CLAIMS = Counter("megacache_publish_claims_total", "Publish claims, by answer", ["result"])
REPORTS = Counter("megacache_reports_total", "Client reports of bad blobs and unloadable "
                  "entries, by the server's verdict", ["verdict"])
PROGRESS = Counter("megacache_job_progress_batches_total",
                   "Job progress batches (ETT telemetry) by result", ["result"])
EVICTIONS = Counter("megacache_evictions_total", "Entries evicted and blobs collected",
                    ["kind"])


class MeteredCollector:
    """A `Collector` counting what each collection removed, whoever asked for it."""

    def __init__(self, inner: Collector) -> None:
        self.inner = inner

    async def collect(self, budget: int | None) -> GcResult | None:
        done = await self.inner.collect(budget)
        if done is not None:
            EVICTIONS.labels("entry").inc(done.evicted)
            EVICTIONS.labels("blob").inc(done.deleted)
        return done


class MeteredTenantCache:
    """A `TenantCache` counting uploads, entry writes and lookups, events, progress
    batches, resolutions, claims and reports: same calls, same results."""

    def __init__(self, inner: TenantCache) -> None:
        self.inner = inner

    # -- counted ------------------------------------------------------------------------
    async def put_blob(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool:
        created = await self.inner.put_blob(digest, size, body)
        UPLOADED.inc(size)
        return created

    async def put_entry(self, key: str, body: bytes, condition: Precondition, *,
                        claims: ProducerClaims | None = None) -> EntryWrite:
        done = await self.inner.put_entry(key, body, condition, claims=claims)
        ENTRY_WRITES.labels("created" if done.created else "replaced").inc()
        return done

    async def get_entry(self, key: str, *, touch: bool = True) -> StoredEntry:
        try:
            entry = await self.inner.get_entry(key, touch=touch)
        except NotFound:
            LOOKUPS.labels("miss").inc()
            raise
        LOOKUPS.labels("hit").inc()
        return entry

    async def resolve(self, key: str, *, job: str, attempt: int,
                      ttl_s: float = DEFAULT_RESOLUTION_TTL_S,
                      fallback: FallbackRule | None = None) -> Resolution:
        done = await self.inner.resolve(key, job=job, attempt=attempt, ttl_s=ttl_s,
                                        fallback=fallback)
        RESOLUTIONS.labels("hit" if done.hit else "miss").inc()
        return done

    async def claim(self, key: str, *, holder: str,
                    lease_s: float = DEFAULT_CLAIM_LEASE_S) -> Claim:
        try:
            got = await self.inner.claim(key, holder=holder, lease_s=lease_s)
        except Conflict:
            CLAIMS.labels("held").inc()
            raise
        CLAIMS.labels("granted").inc()
        return got

    async def report_blob(self, digest: str, *, kind: str, entry_key: str | None,
                          detail: str) -> dict[str, Any]:
        return _count_report(await self.inner.report_blob(
            digest, kind=kind, entry_key=entry_key, detail=detail))

    async def report_entry(self, key: str, *, kind: str, detail: str,
                           job: str | None) -> dict[str, Any]:
        return _count_report(await self.inner.report_entry(key, kind=kind, detail=detail,
                                                           job=job))

    async def add_event(self, body: bytes) -> None:
        try:
            await self.inner.add_event(body)
        except Exception:
            EVENTS.labels("rejected").inc()
            raise
        EVENTS.labels("recorded").inc()

    async def add_progress(self, job: str, body: bytes) -> int:
        try:
            n = await self.inner.add_progress(job, body)
        except Exception:
            PROGRESS.labels("rejected").inc()
            raise
        PROGRESS.labels("recorded").inc()
        return n

    # -- handed on unchanged --------------------------------------------------------------
    async def job_ett(self, job: str, *, since_s: float | None = None) -> dict[str, Any]:
        return await self.inner.job_ett(job, since_s=since_s)

    @property
    def settings(self) -> Settings:
        return self.inner.settings

    @property
    def principal(self) -> Principal:
        return self.inner.principal

    async def blob_size(self, digest: str) -> int | None:
        return await self.inner.blob_size(digest)

    async def recorded_blob_size(self, digest: str) -> int | None:
        return await self.inner.recorded_blob_size(digest)

    def read_blob(self, digest: str, start: int, end: int) -> AsyncIterator[bytes]:
        return self.inner.read_blob(digest, start, end)

    def presigned_url(self, digest: str) -> str | None:
        return self.inner.presigned_url(digest)

    async def list_entries(self, *, namespace: str | None, model: str | None,
                           env: str | None, hw: str | None, limit: int,
                           writers: str | None = None) -> list[StoredEntry]:
        return await self.inner.list_entries(namespace=namespace, model=model, env=env,
                                             hw=hw, limit=limit, writers=writers)

    async def delete_entry(self, key: str) -> None:
        await self.inner.delete_entry(key)

    async def set_pinned(self, key: str, pinned: bool) -> None:
        await self.inner.set_pinned(key, pinned)

    async def resolution_provenance(self, done: Resolution) -> str:
        return await self.inner.resolution_provenance(done)

    async def release_claim(self, key: str, *, holder: str) -> None:
        await self.inner.release_claim(key, holder=holder)

    async def quarantines(self, *, limit: int = 100) -> list[dict[str, Any]]:
        return await self.inner.quarantines(limit=limit)

    async def ett_trend(self, *, days: float, period: str,
                        model: str | None = None) -> dict[str, Any]:
        return await self.inner.ett_trend(days=days, period=period, model=model)

    async def stats(self, *, since: float | None) -> dict[str, Any]:
        return await self.inner.stats(since=since)

    async def jobs(self, *, limit: int) -> list[dict[str, Any]]:
        return await self.inner.jobs(limit=limit)

    async def dashboard(self, *, hours: float) -> dict[str, Any]:
        return await self.inner.dashboard(hours=hours)

    async def figures(self) -> Figures:
        return await self.inner.figures()

    def viewing(self) -> AbstractAsyncContextManager[None]:
        return self.inner.viewing()


def _count_report(verdict: dict[str, Any]) -> dict[str, Any]:
    REPORTS.labels(verdict["verdict"]).inc()
    return verdict
