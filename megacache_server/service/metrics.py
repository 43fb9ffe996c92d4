"""Cache metrics: subclasses of the cache service that count, and the index's sums as metrics.

As in bazel-remote (`disk/metrics.go`), the service knows nothing of Prometheus:
`MeteredTenantCache` is a `TenantCache` that overrides only the calls it counts, and
`MeteredCache` binds callers to it; `cache_metrics()` turns the index's running totals
(which never go down) into metric families at scrape time. Per-request HTTP numbers live in
`api.request_metrics`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from anyio import to_thread
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from megacache_client.wire.events import REPLAYS
from megacache_server import __version__
from megacache_server.errors import Conflict, NotFound
from megacache_server.service.auth import Principal
from megacache_server.service.cache import Cache, EntryWrite, TenantCache
from megacache_server.service.eviction import GcResult
from megacache_server.store.index import rollups
from megacache_server.store.index.base import (
    MAX_QUARANTINE_RECORDS,
    Claim,
    ModelStats,
    Precondition,
    Resolution,
    StoredEntry,
)

LOOKUPS = Counter("megacache_lookups_total", "Entry lookups by result", ["result"])
UPLOADED = Counter("megacache_blob_upload_bytes_total", "Blob bytes uploaded")
ENTRY_WRITES = Counter("megacache_entry_writes_total", "Entries written", ["result"])
EVENTS = Counter("megacache_events_total", "Client events by result", ["result"])
RESOLUTIONS = Counter("megacache_job_resolutions_total",
                      "Job-attempt resolutions served, by what they resolved to", ["result"])
CLAIMS = Counter("megacache_publish_claims_total", "Publish claims, by answer", ["result"])
REPORTS = Counter("megacache_reports_total", "Client reports of bad blobs and unloadable "
                  "entries, by the server's verdict", ["verdict"])
EVICTIONS = Counter("megacache_evictions_total", "Entries evicted and blobs collected",
                    ["kind"])


class MeteredTenantCache(TenantCache):
    """A `TenantCache` that counts what it serves: same calls, same results."""

    async def put_blob(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool:
        created = await super().put_blob(digest, size, body)
        UPLOADED.inc(size)
        return created

    async def put_entry(self, key: str, body: bytes, condition: Precondition,
                        **kwargs: Any) -> EntryWrite:
        done = await super().put_entry(key, body, condition, **kwargs)
        ENTRY_WRITES.labels("created" if done.created else "replaced").inc()
        return done

    async def get_entry(self, key: str, *, touch: bool = True) -> StoredEntry:
        try:
            entry = await super().get_entry(key, touch=touch)
        except NotFound:
            LOOKUPS.labels("miss").inc()
            raise
        LOOKUPS.labels("hit").inc()
        return entry

    async def resolve(self, key: str, **kwargs: Any) -> Resolution:
        done = await super().resolve(key, **kwargs)
        RESOLUTIONS.labels("hit" if done.hit else "miss").inc()
        return done

    async def claim(self, key: str, **kwargs: Any) -> Claim:
        try:
            got = await super().claim(key, **kwargs)
        except Conflict:
            CLAIMS.labels("held").inc()
            raise
        CLAIMS.labels("granted").inc()
        return got

    async def report_blob(self, digest: str, **kwargs: Any) -> dict[str, Any]:
        return self._count_report(await super().report_blob(digest, **kwargs))

    async def report_entry(self, key: str, **kwargs: Any) -> dict[str, Any]:
        return self._count_report(await super().report_entry(key, **kwargs))

    @staticmethod
    def _count_report(verdict: dict[str, Any]) -> dict[str, Any]:
        REPORTS.labels(verdict["verdict"]).inc()
        return verdict

    async def add_event(self, body: bytes) -> None:
        try:
            await super().add_event(body)
        except Exception:
            EVENTS.labels("rejected").inc()
            raise
        EVENTS.labels("recorded").inc()


class MeteredCache(Cache):
    """The process-wide cache, counting what collection removes; the caches it binds to
    callers count what they serve."""

    def bound(self, principal: Principal) -> MeteredTenantCache:
        return MeteredTenantCache(self, principal)

    async def collect(self, **kwargs: Any) -> GcResult | None:
        done = await super().collect(**kwargs)
        if done is not None:
            EVICTIONS.labels("entry").inc(done.evicted)
            EVICTIONS.labels("blob").inc(done.deleted)
        return done


class _Families(Collector):
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


async def cache_metrics(cache: TenantCache) -> bytes:
    """The cache's own numbers for this caller's namespaces, in Prometheus text format."""
    models = await cache.index.stats(namespace=cache.scope)
    entries, entry_bytes = await cache.index.usage(cache.scope)
    families: list[Any] = []
    info = InfoMetricFamily("megacache_build", "Server build")
    info.add_metric([], {"version": __version__, "index": cache.index.name,
                         "blobs": cache.storage.blobs.name})
    families.append(info)
    entries_g = GaugeMetricFamily("megacache_entries", "Entries in the index")
    entries_g.add_metric([], entries)
    bytes_g = GaugeMetricFamily("megacache_entry_bytes",
                                "Bytes named by entries (shared blobs counted per entry)")
    bytes_g.add_metric([], entry_bytes)
    families += [entries_g, bytes_g]
    if cache.scope is None:
        store = GaugeMetricFamily("megacache_store_bytes", "Bytes of blobs stored")
        store.add_metric([], await cache.index.stored_bytes())
        families.append(store)
        if cache.cache.budget is not None:
            budget = GaugeMetricFamily("megacache_store_budget_bytes", "Store budget")
            budget.add_metric([], cache.cache.budget)
            families.append(budget)
    families += await _trust_families(cache)
    # Per-model series (~80 per model, the job histograms' buckets included) are built and
    # rendered in a worker thread: with hundreds of models that is 100+ ms of Python, which
    # on the event loop every lookup would wait for.
    return await to_thread.run_sync(
        lambda: _render([*families, *_model_families(models)]) + _job_histograms(models))


async def _trust_families(cache: TenantCache) -> list[Any]:
    """Quarantines by reason (shared by every replica: from the index) and, for the operator,
    how far the scrub is behind (the age of the longest-unverified blob)."""
    summary = await cache.quarantine_summary()
    total = CounterMetricFamily("megacache_quarantined_blobs",
                                "Blobs quarantined (reason load: entries withdrawn)",
                                labels=["reason"])
    for reason, count in sorted(summary["by_reason"].items()):
        total.add_metric([reason], count)
    families: list[Any] = [total]
    if cache.scope is None:
        held = GaugeMetricFamily("megacache_quarantine_records",
                                 "Quarantine records kept for inspection")
        held.add_metric([], len(await cache.index.quarantines(namespace=None,
                                                               limit=MAX_QUARANTINE_RECORDS)))
        oldest = await cache.index.least_verified(1)
        age = GaugeMetricFamily("megacache_scrub_oldest_unverified_seconds",
                                "Seconds since the longest-unverified blob was last hashed")
        age.add_metric([], max(0.0, time.time() - oldest[0][1]) if oldest else 0.0)
        families += [held, age]
    return families


def _model_families(models: list[ModelStats]) -> list[Any]:
    labels = ["namespace", "model"]
    runs = CounterMetricFamily("megacache_runs", "Client runs reported, by outcome",
                               labels=[*labels, "outcome"])
    saved = CounterMetricFamily("megacache_compile_saved_seconds",
                                "Compile seconds the cache saved", labels=labels)
    spent = CounterMetricFamily("megacache_client_compile_seconds",
                                "Compile seconds clients spent", labels=labels)
    down = CounterMetricFamily("megacache_client_download_bytes",
                               "Bytes clients downloaded", labels=labels)
    tts = CounterMetricFamily("megacache_time_to_start_seconds",
                              "Seconds from process start to the first compiled step, summed",
                              labels=labels)
    tts_n = CounterMetricFamily("megacache_time_to_start_runs",
                                "Runs that reported a time to start", labels=labels)
    for m in models:
        key = [m.namespace, m.model]
        for outcome, count in sorted(m.outcomes.items()):
            runs.add_metric([*key, outcome], count)
        saved.add_metric(key, m.saved_s)
        spent.add_metric(key, m.compile_s)
        down.add_metric(key, m.bytes_down)
        tts.add_metric(key, m.tts_s)
        tts_n.add_metric(key, m.tts_n)
    return [runs, saved, spent, down, tts, tts_n, _replay_family(models),
            *_job_families(models)]


def _replay_family(models: list[ModelStats]) -> Any:
    """Runs by whether they replayed the entry's artifacts (full, partial, rebuilt), per
    namespace: the per-model split is on the dashboard and in the stats."""
    replays = CounterMetricFamily("megacache_replays",
                                  "Client runs by replay of the entry's artifacts: full (no "
                                  "compile), partial, rebuilt", labels=["namespace", "replay"])
    per_namespace: dict[str, dict[str, int]] = {}
    for m in models:
        sums = per_namespace.setdefault(m.namespace, dict.fromkeys(REPLAYS, 0))
        for replay, count in m.replays.items():
            sums[replay] += count
    for namespace, sums in sorted(per_namespace.items()):
        for replay in REPLAYS:
            replays.add_metric([namespace, replay], sums[replay])
    return replays


JOB_HISTOGRAMS = {
    "start": ("megacache_job_time_to_start_seconds",
              "Job attempts 0 (and runs without a job): process start to the first compiled "
              "step of the slowest rank"),
    "recover": ("megacache_job_time_to_recover_seconds",
                "Job attempts after the first: process start to the first compiled step of "
                "the slowest rank"),
    "compile": ("megacache_job_compile_seconds",
                "Compile seconds of the job attempt's slowest-compiling rank"),
}


def _job_families(models: list[ModelStats]) -> list[Any]:
    labels = ["namespace", "model"]
    attempts = CounterMetricFamily("megacache_job_attempts",
                                   "Job attempts reported (each once, however many ranks)",
                                   labels=labels)
    restarts = CounterMetricFamily("megacache_job_restarts",
                                   "Job attempts after the first (restarts)", labels=labels)
    for m in models:
        attempts.add_metric([m.namespace, m.model], m.attempts)
        restarts.add_metric([m.namespace, m.model], m.restarts)
    return [attempts, restarts]


def _job_histograms(models: list[ModelStats]) -> bytes:
    """Job attempts as Prometheus histograms, from the rollups' bucket counts (an attempt
    counted once whatever its number of ranks: its slowest rank's seconds). Written as
    text directly: 69 samples a model, ~5x faster than through metric family objects."""
    bounds = [floatToGoString(b) for b in rollups.BUCKETS] + ["+Inf"]  # le="90.0", as usual
    lines: list[str] = []
    for histogram, (name, doc) in JOB_HISTOGRAMS.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
        for m in models:
            key = f'namespace="{_escape(m.namespace)}",model="{_escape(m.model)}"'
            cumulative = 0.0
            for bound, count in zip(bounds, m.buckets(histogram), strict=True):
                cumulative += max(count, 0.0)
                lines.append(f'{name}_bucket{{{key},le="{bound}"}} {cumulative!r}')
            lines.append(f"{name}_count{{{key}}} {cumulative!r}")
            lines.append(f"{name}_sum{{{key}}} {float(m.jobs[histogram + '_sum'])!r}")
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    """A label value as the Prometheus text format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _render(families: list[Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)

