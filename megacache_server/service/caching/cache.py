"""The cache service, process-wide: `Cache` builds the parts once and binds each caller to
them; the calls that are no caller's (GC, tokens, fsck, readiness) are its own.

The HTTP routes reach it as the `TenantCache` a request's token names (`Cache.authorized`);
the CLI, the background GC and fsck call `Cache` itself. Nothing else touches storage.
"""

from __future__ import annotations

from collections.abc import Callable

from megacache_server.errors import ApiError, ServiceUnavailable
from megacache_server.service.caching.tenant import BoundCache, Parts, TenantCache
from megacache_server.service.housekeeping import fsck
from megacache_server.service.housekeeping.collector import Collector, LocalCollector
from megacache_server.service.housekeeping.eviction import GcPlan, GcResult
from megacache_server.service.security import auth
from megacache_server.service.security.auth import Principal, Scope
from megacache_server.settings import Settings
from megacache_server.store.index.base import TokenRecord
from megacache_server.store.storage import Storage


class Cache:
    """The process-wide cache: storage, the parts every caller shares, and the rules that
    are not about one caller."""

    def __init__(self, settings: Settings, storage: Storage,
                 collector: Collector | None = None, *,
                 wrap: Callable[[TenantCache], TenantCache] | None = None) -> None:
        """`collector` runs every collection that is not given a plan, whoever asks (the
        background GC, an upload making room): this process's `LocalCollector` unless
        another is given. `wrap` decorates each caller's cache before a route gets it."""
        self.settings = settings
        self.storage = storage
        self.local = LocalCollector(settings, storage)
        self.collector = collector or self.local
        self.parts = Parts.build(settings, storage, self.collector)
        self.wrap = wrap

    def bound(self, principal: Principal) -> TenantCache:
        cache = BoundCache(self.parts, principal)
        return self.wrap(cache) if self.wrap is not None else cache

    async def authorized(self, authorization: str, scope: Scope) -> TenantCache:
        """The cache bound to the caller an `Authorization` header value names, who must
        hold `scope` (401 or 403 if not)."""
        principal = await auth.authenticate(self.settings, self.storage.index, authorization)
        return self.bound(auth.authorize(principal, scope))

    # -- maintenance: GC, tokens, fsck, readiness -------------------------------------
    async def gc_plan(self, *, budget: int | None = None) -> GcPlan:
        return await self.local.plan(budget=budget)

    async def collect(self, *, budget: int | None = None,
                      gc_plan: GcPlan | None = None) -> GcResult | None:
        """Evict over budget and collect unreferenced blobs, one collector at a time across
        every process and replica; None when another collector holds the lock. A given
        plan (one the CLI printed) is carried out here; else the collector collects."""
        if gc_plan is not None:
            return await self.local.collect(budget, gc_plan=gc_plan)
        return await self.collector.collect(budget)

    async def add_token(self, record: TokenRecord) -> None:
        await self.storage.index.put_token(record)

    async def tokens(self) -> list[TokenRecord]:
        return await self.storage.index.list_tokens()

    async def revoke_token(self, token_id: str) -> bool:
        return await self.storage.index.revoke_token(token_id)

    async def check(self, *, repair: bool, verify: bool) -> fsck.FsckReport:
        return await fsck.check(self.storage, repair=repair, verify=verify)

    async def ready(self) -> dict[str, str]:
        """Storage is reachable and can still write: a full disk is not ready."""
        for name, probe in ((self.storage.blobs.name, self.storage.blobs.ping),
                            (self.storage.index.name,
                             lambda: self.storage.index.ping(write=True))):
            try:
                await probe()
            except ApiError as exc:
                raise type(exc)(f"{name}: {exc.message}", code=exc.code) from exc
            except Exception as exc:  # any backend failure means not ready
                raise ServiceUnavailable(f"{name} unavailable: {exc}") from exc
        return {"status": "ready", "blobs": self.storage.blobs.name,
                "index": self.storage.index.name}
