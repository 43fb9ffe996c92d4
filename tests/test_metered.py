"""The metrics decorators (megacache_server/service/observability/metered.py): a call a route
makes is counted once, what the cache's parts ask each other on its way is not, and every
other call is handed on unchanged."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers import make_fingerprint, make_manifest, sha256
from prometheus_client import REGISTRY

from megacache_server.errors import NotFound
from megacache_server.service.caching.cache import Cache
from megacache_server.service.housekeeping.collector import LocalCollector
from megacache_server.service.observability.metered import MeteredCollector, MeteredTenantCache
from megacache_server.service.security.auth import ANONYMOUS
from megacache_server.settings import Settings
from megacache_server.store.index.base import Precondition
from megacache_server.store.storage import build_storage


def counted(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_only_what_a_route_asks_is_counted(tmp_path: Path) -> None:
    async def main() -> None:
        settings = Settings(data_dir=tmp_path / "data", gc_grace_s=0)
        storage = build_storage(settings)
        await storage.open()
        try:
            cache = Cache(settings, storage, MeteredCollector(LocalCollector(settings, storage)),
                          wrap=MeteredTenantCache)
            tenant = cache.bound(ANONYMOUS)
            assert isinstance(tenant, MeteredTenantCache)
            data = os.urandom(1000)
            await tenant.put_blob(sha256(data), len(data), _chunks(data))
            manifest = make_manifest({"megacache": data}, make_fingerprint(code="metered"))
            before = {r: counted("megacache_lookups_total", result=r) for r in ("hit", "miss")}
            written = await tenant.put_entry(manifest.key, manifest.to_json(), Precondition())
            assert written.created
            assert (await tenant.get_entry(manifest.key)).key == manifest.key
            with pytest.raises(NotFound):
                await tenant.get_entry("0" * 64)
            # each of these looks the entry up inside the service: none is a lookup counted
            done = await tenant.resolve(manifest.key, job="job-1", attempt=0)
            assert done.hit
            await tenant.set_pinned(manifest.key, True)
            assert [e.key for e in await tenant.list_entries(
                namespace=None, model=None, env=None, hw=None, limit=5)] == [manifest.key]
            after = {r: counted("megacache_lookups_total", result=r) for r in ("hit", "miss")}
            assert {r: after[r] - before[r] for r in after} == {"hit": 1, "miss": 1}

            collected = counted("megacache_evictions_total", kind="blob")
            orphan = os.urandom(500)  # no entry names it
            await tenant.put_blob(sha256(orphan), len(orphan), _chunks(orphan))
            done = await cache.collect()  # through the collector every collection takes
            assert done is not None and done.deleted == 1
            assert counted("megacache_evictions_total", kind="blob") == collected + 1
        finally:
            await storage.close()

    asyncio.run(main())
