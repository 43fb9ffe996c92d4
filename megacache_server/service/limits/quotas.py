"""How much one caller may use: the bytes it holds and the requests it makes.

Every limit a caller can run into is decided here, so each kind of limit has one place to
change: the pending quota (uploads no manifest names yet), a namespace's quota of entries
and bytes, the store budget, a namespace's live job records, and the rates of events,
reports, job requests and job progress per token. Each is kept in the index, so it holds
across every worker and replica.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from megacache_server.errors import InsufficientStorage
from megacache_server.service.housekeeping.collector import Collector
from megacache_server.service.limits.ratelimit import Limit, admit
from megacache_server.service.security.auth import Principal
from megacache_server.settings import Settings
from megacache_server.store.index.base import Index

log = logging.getLogger("megacache.cache")


class Quotas:
    """The limits of every caller of this process, and the state they are kept with."""

    def __init__(self, settings: Settings, index: Index, collector: Collector) -> None:
        self.settings = settings
        self.index = index
        self.collector = collector
        """What makes room in the store when an upload would pass its budget."""
        self.events = Limit("events", "events", settings.event_rate, settings.event_burst)
        self.reports = Limit("reports", "reports", settings.report_rate, settings.report_burst)
        self.jobs = Limit("jobs", "job resolves and claims", settings.job_rate,
                          settings.job_burst)
        self.progress = Limit("progress", "job progress batches", settings.progress_rate,
                              settings.progress_burst)

    # -- bytes ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def pending(self, namespace: str, size: int) -> AsyncIterator[Keep]:
        """Hold `size` bytes of the namespace's pending quota while an upload streams, and
        until it is recorded; yields what renews the hold as the body's chunks arrive.

        Blobs no manifest names yet are capped per namespace: one tenant's unreferenced
        uploads can fill neither the store nor force out another tenant's entries. The hold
        is kept in the index (`QuotaStore`), decided atomically with what the namespace
        already holds, so the cap holds however many connections a tenant opens to however
        many workers and replicas; a worker that dies mid-upload holds nothing for longer
        than the hold's lifetime (`hold_ttl_s`)."""
        cap = self.settings.pending_cap()
        if cap is None or size == 0:
            yield _as_sent
            return
        hold_id, ttl = uuid.uuid4().hex, self.hold_ttl_s()
        got = await self.index.hold_pending(namespace, hold_id, size, cap, ttl, time.time())
        if not got.granted:
            raise _over_pending(namespace, size, cap, got.pending, got.held)
        try:
            yield functools.partial(self._renewing, namespace, hold_id, size, cap)
        finally:
            with contextlib.suppress(Exception):  # else it lapses by itself
                await self.index.release_pending(namespace, hold_id)

    def hold_ttl_s(self) -> float:
        """How long a hold lives unrenewed: longer than a third of itself plus the longest
        silence an upload may keep (`upload_idle_timeout_s`), so one renewed as its chunks
        arrive never lapses while the upload lives."""
        return 2 * self.settings.upload_idle_timeout_s + 30

    async def _renewing(self, namespace: str, hold_id: str, size: int, cap: int,
                        body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        ttl = self.hold_ttl_s()
        renewed = time.monotonic()
        async for chunk in body:
            if time.monotonic() - renewed > ttl / 3:
                got = await self.index.hold_pending(namespace, hold_id, size, cap, ttl,
                                                    time.time())
                if not got.granted:  # it lapsed and the room is gone meanwhile
                    raise _over_pending(namespace, size, cap, got.pending, got.held)
                renewed = time.monotonic()
            yield chunk

    async def make_room(self, size: int) -> None:
        """Refuse an upload that would crowd others out; evict LRU entries for one that fits."""
        budget = self.settings.budget()
        if budget is None:
            return
        used = await self.index.stored_bytes()
        if used + size <= budget:
            return
        await self.collector.collect(max(0, budget - size))
        used = await self.index.stored_bytes()
        if used + size > budget:
            raise InsufficientStorage(
                f"store budget {budget} bytes: {used} used, {size} more do not fit even after "
                "evicting unpinned entries", code="store_full", used=used, budget=budget)

    async def fit_entry(self, namespace: str, key: str, size: int) -> None:
        """Over its quota, a namespace evicts its own least recently used entries, never
        another's; when its pinned entries alone fill it, the write is refused."""
        max_entries = self.settings.namespace_quota_entries
        max_bytes = self.settings.namespace_quota_bytes
        if max_entries is None and max_bytes is None:
            return
        entries, used = await self.index.usage(namespace)
        existing = await self.index.get(key, touch=False)
        if existing is not None:
            entries, used = entries - 1, used - existing.size

        def over(n: int, b: int) -> bool:
            return ((max_entries is not None and n + 1 > max_entries)
                    or (max_bytes is not None and b + size > int(max_bytes)))

        if not over(entries, used):
            return
        for victim in await self.index.lru_entries(256, namespace=namespace):
            if victim.key == key:
                continue
            if await self.index.delete(victim.key):
                entries, used = entries - 1, used - victim.size
                log.info("quota: evicted %s of namespace %s", victim.key, namespace)
            if not over(entries, used):
                return
        raise InsufficientStorage(
            f"namespace {namespace!r} is at its quota ({entries} entries, {used} bytes) with "
            "nothing left to evict", code="namespace_quota", entries=entries, used=used)

    # -- requests ------------------------------------------------------------------------
    async def admit_event(self, principal: Principal) -> None:
        """Per token; auth off (loopback, one trusted caller) has none and is not limited."""
        if principal.namespace is not None:
            await admit(self.index, self.events, principal)

    async def admit_progress(self, principal: Principal) -> None:
        """Per token; auth off (loopback, one trusted caller) is not limited."""
        if principal.namespace is not None:
            await admit(self.index, self.progress, principal)

    async def admit_report(self, principal: Principal) -> None:
        """Per token (per caller name with auth off, where there is one caller)."""
        await admit(self.index, self.reports, principal)

    async def admit_job(self, principal: Principal) -> None:
        """Per token; auth off is not limited (its job's ranks all share one caller)."""
        if principal.namespace is not None:
            await admit(self.index, self.jobs, principal)

    def job_records(self) -> int | None:
        """The live job resolutions and claims one namespace may hold (None: no cap)."""
        return self.settings.namespace_job_records or None


Keep = Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]
"""What an upload's body passes through while it holds pending quota (renewing the hold)."""


def _as_sent(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    return body


def _over_pending(namespace: str, size: int, cap: int, pending: int,
                  held: int) -> InsufficientStorage:
    return InsufficientStorage(
        f"namespace {namespace!r} holds {pending} bytes of blobs none of its entries names "
        f"and {held} bytes in uploads; {size} more would pass its limit of {cap}: write the "
        "manifests that name them first", code="pending_quota", pending=pending + held,
        limit=cap)
