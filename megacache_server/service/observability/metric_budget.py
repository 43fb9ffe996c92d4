"""The per-(namespace, model) series of `/metrics`, within budgets: what one scrape costs
is bounded by the settings, whatever names tenants post.

Each model a namespace reports is ~80 series (counters, replays, three job histograms). The
rollups keep up to `rollups.MAX_MODELS` (2,000) model names per namespace, which one tenant
posting a new name with each event reaches in seconds; every scrape then carried 164k lines
(52.6 MiB), for every scraper. So a namespace shows its `per_namespace` busiest models (by
runs, then job attempts) and one series `model="other"` summing the rest, and the scrape as
a whole shows at most `total` (namespace, model) series: past it, the namespaces that ran
least are folded into `namespace="other", model="other"`. Sums are kept whole: a folded
model's runs and seconds still count, under `other`."""

from __future__ import annotations

from dataclasses import fields

from megacache_server.store.index.base import ModelStats

OTHER = "other"
"""The label value folded series get (a model really named `other` adds to it)."""


def within_budget(models: list[ModelStats], per_namespace: int, total: int) -> list[ModelStats]:
    """`models` with each namespace's beyond its `per_namespace` busiest folded into one
    `other` model, then namespaces beyond `total` series folded into namespace `other`."""
    by_ns: dict[str, list[ModelStats]] = {}
    for m in models:
        by_ns.setdefault(m.namespace, []).append(m)
    kept: list[list[ModelStats]] = [_fold_models(ns, ms, per_namespace)
                                    for ns, ms in by_ns.items()]
    kept.sort(key=lambda ms: (-sum(m.runs + m.attempts for m in ms), ms[0].namespace))
    out: list[ModelStats] = []
    rest: list[ModelStats] = []
    for ms in kept:
        if len(out) + len(ms) <= max(total - 1, 0):  # one series left for namespace `other`
            out += ms
        else:
            rest += ms
    if rest:
        out.append(_sum(OTHER, OTHER, rest))
    return out


def _fold_models(namespace: str, models: list[ModelStats], keep: int) -> list[ModelStats]:
    if len(models) <= keep + 1:
        return models
    ranked = sorted(models, key=lambda m: (-m.runs, -m.attempts, m.model))
    top = [m for m in ranked[:keep] if m.model != OTHER]
    rest = [m for m in ranked[:keep] if m.model == OTHER] + ranked[keep:]
    return [*top, _sum(namespace, OTHER, rest)]


def _sum(namespace: str, model: str, models: list[ModelStats]) -> ModelStats:
    """One ModelStats adding up `models` (every number and every dict of numbers)."""
    into = ModelStats(namespace=namespace, model=model)
    for f in fields(ModelStats):
        if f.name in ("namespace", "model"):
            continue
        mine = getattr(into, f.name)
        if isinstance(mine, dict):
            for m in models:
                for k, v in getattr(m, f.name).items():
                    mine[k] = mine.get(k, 0) + v
        else:
            setattr(into, f.name, mine + sum(getattr(m, f.name) for m in models))
    return into
