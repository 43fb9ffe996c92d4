"""Client runs in (`EventIntake`), and what they add up to out (`EventReader`), each within
the caller's namespace: an event is recorded in the namespace of the token that sent it
(never one the body names), and stats, jobs, the dashboard and /metrics read only the
caller's namespace (all, auth off)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from anyio import to_thread

from megacache_client.wire.events import Event
from megacache_server.errors import Unprocessable
from megacache_server.service.ett import report as ett_report
from megacache_server.service.ett.intake import ProgressIntake
from megacache_server.service.ett.split import JobSplit
from megacache_server.service.limits.quotas import Quotas
from megacache_server.service.observability import reports
from megacache_server.service.observability.metric_budget import within_budget
from megacache_server.service.security.auth import Principal
from megacache_server.service.security.quarantine import Quarantine
from megacache_server.settings import Settings
from megacache_server.store.index.base import MAX_QUARANTINE_RECORDS, Index, ModelStats
from megacache_server.store.storage import Storage


@dataclass(frozen=True)
class StoreFigures:
    """What only the operator (every namespace) sees of the store as a whole."""

    stored_bytes: int
    budget: int | None
    quarantine_records: int
    unverified_for_s: float
    """Since the longest-unverified blob was last hashed: how far the scrub is behind."""


@dataclass(frozen=True)
class Figures:
    """The cache's own numbers for one reader, read at scrape time (`metrics` renders them)."""

    index: str
    blobs: str
    models: list[ModelStats]
    entries: int
    entry_bytes: int
    quarantined: dict[str, int]
    """Quarantines by reason (shared by every replica: from the index)."""
    store: StoreFigures | None
    """None for a reader confined to a namespace."""
    jobs: list[JobSplit] = field(default_factory=list)
    """The ETT split of the jobs that reported progress last (`progress.MAX_ETT_JOBS`)."""


class EventIntake:
    """The write side: recording client runs, each within its quota of events."""

    def __init__(self, index: Index, quotas: Quotas) -> None:
        self.index = index
        self.quotas = quotas

    async def add_event(self, principal: Principal, body: bytes) -> None:
        """Record one run in the caller's namespace."""
        await self.quotas.admit_event(principal)
        event = Unprocessable.parsed(Event, body, "event", "invalid_event")
        await self.index.add_event(principal.home, event)


class EventReader:
    """The read side: the reports made of the runs recorded (stats, jobs, the dashboard,
    the figures of /metrics), with the ETT split of the jobs that reported progress."""

    def __init__(self, settings: Settings, storage: Storage, quarantine: Quarantine,
                 progress: ProgressIntake) -> None:
        self.settings = settings
        self.progress = progress
        self.storage = storage
        self.index = storage.index
        self.quarantine = quarantine

    async def stats(self, principal: Principal, *, since: float | None) -> dict[str, Any]:
        found = await reports.stats(self.index, scope=principal.namespace, since=since)
        return {**found, "quarantine": await self.quarantine.quarantine_summary(principal),
                "ett": await self.progress.report(principal, since=since)}

    async def jobs(self, principal: Principal, *, limit: int) -> list[dict[str, Any]]:
        """The caller's jobs that reported last, with their attempts and, for those that
        reported progress, their ETT split (`ett`: without its attempts; GET
        /v1/jobs/{job}/ett has them)."""
        views = await self.index.recent_jobs(namespace=principal.namespace, limit=limit)
        splits = await self.progress.splits(principal, since=0.0, limit=limit, views=views)
        return await to_thread.run_sync(reports.job_rows, views, splits, limit)

    async def dashboard(self, principal: Principal, *, hours: float) -> dict[str, Any]:
        """Everything the dashboard shows, from rollups: cost independent of history."""
        found = await reports.dashboard(self.index, scope=principal.namespace,
                                        budget=self.settings.budget(), hours=hours)
        since = found["generated_at"] - hours * 3600
        splits = await self.progress.splits(principal, since=since)
        return {**found, "quarantine": await self.quarantine.quarantines(principal, limit=20),
                "ett": await to_thread.run_sync(ett_report.tiles, splits, since,
                                                found["generated_at"], reports.JOBS_SHOWN)}

    async def figures(self, principal: Principal) -> Figures:
        """The numbers /metrics shows this caller: its namespace's, and the store's as a
        whole only to the operator (every namespace)."""
        scope = principal.namespace
        models = within_budget(await self.index.stats(namespace=scope),
                               self.settings.metrics_models_per_namespace,
                               self.settings.metrics_models)
        entries, entry_bytes = await self.index.usage(scope)
        store = None
        if scope is None:
            oldest = await self.index.least_verified(1)
            store = StoreFigures(
                stored_bytes=await self.index.stored_bytes(), budget=self.settings.budget(),
                quarantine_records=len(await self.index.quarantines(
                    namespace=None, limit=MAX_QUARANTINE_RECORDS)),
                unverified_for_s=max(0.0, time.time() - oldest[0][1]) if oldest else 0.0)
        summary = await self.quarantine.quarantine_summary(principal)
        return Figures(index=self.index.name, blobs=self.storage.blobs.name, models=models,
                       entries=entries, entry_bytes=entry_bytes,
                       quarantined=summary["by_reason"], store=store,
                       jobs=await self.progress.splits(principal, since=0.0))
