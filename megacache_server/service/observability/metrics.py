"""The cache's own numbers as Prometheus metric families, rendered at scrape time.

The index keeps running totals (which never go down) shared by every worker and replica;
`cache_metrics()` reads them for the scraping caller (`TenantCache.figures`) and renders
them. What this process served is counted by the decorators of `metered`; per-request HTTP
numbers live in `api.request_metrics`.
"""

from __future__ import annotations

from typing import Any

from anyio import to_thread
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from megacache_client.wire.events import REPLAYS
from megacache_client.wire.text import escape_foreign
from megacache_server import __version__
from megacache_server.service.caching.tenant import TenantCache
from megacache_server.service.ett.metrics import ett_families
from megacache_server.service.observability.events import Figures
from megacache_server.store.index import rollups
from megacache_server.store.index.base import ModelStats

MODEL_SUMS = (
    ("megacache_compile_saved_seconds", "Compile seconds the cache saved", "saved_s"),
    ("megacache_client_compile_seconds", "Compile seconds clients spent", "compile_s"),
    ("megacache_client_download_bytes", "Bytes clients downloaded", "bytes_down"),
    ("megacache_time_to_start_seconds",
     "Seconds from process start to the first compiled step, summed", "tts_s"),
    ("megacache_time_to_start_runs", "Runs that reported a time to start", "tts_n"),
)
"""Counters per (namespace, model): name, help, and the `ModelStats` field they read."""
JOB_SUMS = (
    ("megacache_job_attempts", "Job attempts reported (each once, however many ranks)",
     "attempts"),
    ("megacache_job_restarts", "Job attempts after the first (restarts)", "restarts"),
)


class _Families(Collector):
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


async def cache_metrics(cache: TenantCache) -> bytes:
    """The cache's own numbers for this caller's namespaces, in Prometheus text format."""
    figures = await cache.figures()
    families: list[Any] = []
    info = InfoMetricFamily("megacache_build", "Server build")
    info.add_metric([], {"version": __version__, "index": figures.index,
                         "blobs": figures.blobs})
    families.append(info)
    entries_g = GaugeMetricFamily("megacache_entries", "Entries in the index")
    entries_g.add_metric([], figures.entries)
    bytes_g = GaugeMetricFamily("megacache_entry_bytes",
                                "Bytes named by entries (shared blobs counted per entry)")
    bytes_g.add_metric([], figures.entry_bytes)
    families += [entries_g, bytes_g]
    if figures.store is not None:
        store = GaugeMetricFamily("megacache_store_bytes", "Bytes of blobs stored")
        store.add_metric([], figures.store.stored_bytes)
        families.append(store)
        if figures.store.budget is not None:
            budget = GaugeMetricFamily("megacache_store_budget_bytes", "Store budget")
            budget.add_metric([], figures.store.budget)
            families.append(budget)
    families += _trust_families(figures)
    models = figures.models
    # Per-model series (~80 per model, the job histograms' buckets included) are built and
    # rendered in a worker thread: with hundreds of models that is 100+ ms of Python, which
    # on the event loop every lookup would wait for.
    return await to_thread.run_sync(
        lambda: _render([*families, *_model_families(models)]) + _job_histograms(models)
        + ett_families(figures.jobs, {(m.namespace, m.model) for m in models}))


def _trust_families(figures: Figures) -> list[Any]:
    """Quarantines by reason and, for the operator, how far the scrub is behind (the age of
    the longest-unverified blob)."""
    total = CounterMetricFamily("megacache_quarantined_blobs",
                                "Blobs quarantined (reason load: entries withdrawn)",
                                labels=["reason"])
    for reason, count in sorted(figures.quarantined.items()):
        total.add_metric([reason], count)
    families: list[Any] = [total]
    if figures.store is not None:
        held = GaugeMetricFamily("megacache_quarantine_records",
                                 "Quarantine records kept for inspection")
        held.add_metric([], figures.store.quarantine_records)
        age = GaugeMetricFamily("megacache_scrub_oldest_unverified_seconds",
                                "Seconds since the longest-unverified blob was last hashed")
        age.add_metric([], figures.store.unverified_for_s)
        families += [held, age]
    return families


def _model_families(models: list[ModelStats]) -> list[Any]:
    runs = CounterMetricFamily("megacache_runs", "Client runs reported, by outcome",
                               labels=["namespace", "model", "outcome"])
    for m in models:
        for outcome, count in sorted(m.outcomes.items()):
            runs.add_metric([m.namespace, m.model, outcome], count)
    return [runs, *_per_model(models, MODEL_SUMS), _replay_family(models),
            *_per_model(models, JOB_SUMS)]


def _per_model(models: list[ModelStats], sums: tuple[tuple[str, str, str], ...]
               ) -> list[Any]:
    families = []
    for name, doc, field in sums:
        family = CounterMetricFamily(name, doc, labels=["namespace", "model"])
        for m in models:
            family.add_metric([m.namespace, m.model], getattr(m, field))
        families.append(family)
    return families


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
    "start": ("megacache_run_first_step_seconds",
              "Job attempts 0 (and runs without a job): process start to the first compiled "
              "step of the slowest rank (the cache's part of time to start; time to start "
              "itself is megacache_job_time_to_start_seconds)"),
    "recover": ("megacache_rerun_first_step_seconds",
                "Job attempts after the first: process start to the first compiled step of "
                "the slowest rank (the cache's part of time to recover; time to recover "
                "itself is megacache_job_time_to_recover_seconds)"),
    "compile": ("megacache_job_compile_seconds",
                "Compile seconds of the job attempt's slowest-compiling rank"),
}


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
    """A label value as the Prometheus text format quotes it, foreign text escaped first
    (a model name stored by an older server may hold CR, NUL or ESC)."""
    value = escape_foreign(value)
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _render(families: list[Any]) -> bytes:
    """The families as Prometheus text. Label values are tenants' text: prometheus_client
    escapes only backslash, newline and quote, so CR, NUL and ESC are escaped here."""
    for family in families:
        family.samples = [s._replace(labels={k: escape_foreign(v) for k, v in s.labels.items()})
                          for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)

