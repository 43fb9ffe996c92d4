"""Budgets of /metrics series (#47 item 5): one tenant posting more model names than its
budget shows at most K series and one `other`; another tenant's series are all there; a
scrape stays bounded in lines and bytes however many names and namespaces there are."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from megacache_server.service.observability import metrics
from megacache_server.service.observability.metric_budget import OTHER, within_budget
from megacache_server.store.index.base import ModelStats


def _model(ns: str, name: str, runs: int) -> ModelStats:
    m = ModelStats(namespace=ns, model=name, runs=runs, saved_s=float(runs))
    m.outcomes["hit"] = runs
    return m


def _scrape(models: list[ModelStats]) -> str:
    return (metrics._render(metrics._model_families(models)) + metrics._job_histograms(models)
            ).decode()


def _series(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in text_string_to_metric_families(text):
        if f.name == "megacache_runs":
            for s in f.samples:
                out.setdefault(s.labels["namespace"], set()).add(s.labels["model"])
    return out


def test_a_flooding_tenant_shows_k_models_and_other_and_the_other_tenant_all() -> None:
    flood = [_model("a", f"m{i}", 1 + i % 7) for i in range(2000)]
    calm = [_model("b", f"b{i}", 3) for i in range(5)]
    before = _scrape(flood + calm)
    after = _scrape(within_budget(flood + calm, 10, 500))
    shown = _series(after)
    assert len(shown["a"]) == 11 and OTHER in shown["a"]
    assert shown["b"] == {f"b{i}" for i in range(5)}
    assert len(after.splitlines()) * 50 < len(before.splitlines())
    assert len(after) * 50 < len(before)
    folded = within_budget(flood + calm, 10, 500)
    assert sum(m.runs for m in folded if m.namespace == "a") == sum(m.runs for m in flood)
    assert sum(m.saved_s for m in folded) == sum(m.saved_s for m in flood + calm)


def test_the_scrape_is_bounded_whatever_the_namespaces() -> None:
    many = [_model(f"ns{n}", f"m{i}", 1) for n in range(300) for i in range(20)]
    folded = within_budget(many, 10, 100)
    assert len(folded) <= 100
    assert any(m.namespace == OTHER and m.model == OTHER for m in folded)
    assert sum(m.runs for m in folded) == len(many)
    shown = _series(_scrape(folded))
    assert sum(len(v) for v in shown.values()) <= 100


def test_within_budget_changes_nothing_under_it() -> None:
    few = [_model("a", "x", 1), _model("b", "y", 2)]
    kept = within_budget(few, 10, 100)
    assert sorted(kept, key=lambda m: m.namespace) == few
