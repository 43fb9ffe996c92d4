"""#58: no read costs another tenant, no tenant erases another's view: the operator's
`/metrics` gives each namespace its own share of jobs, and every read that can cost more
than a lookup is budgeted (`service.limits.views`), which the route table is held to."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import _configured, backend_args
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256, token_client
from prometheus_client.parser import text_string_to_metric_families

from megacache_client.wire import routes
from megacache_server.api.app import create_app
from megacache_server.api.budget import BUDGETED
from megacache_server.settings import Settings

PLAIN = {("GET", "/v1/ac/{key}"), ("GET", "/v1/cas/{digest}"), ("GET", "/v1/whoami"),
         ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/"), ("GET", "/docs"),
         ("GET", "/openapi.json")}
"""GET routes that read one row or nothing (a lookup, a page, a probe): the only ones a
view budget does not cover."""


@pytest.fixture(scope="module")
def fair_server(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args, env = backend_args("sqlite+fs", request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("fair") / "data", *args, "--auth",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_PROGRESS_RATE": "100000",
             "MEGACACHE_PROGRESS_BURST": "100000", "MEGACACHE_VIEW_RATE": "0.2",
             "MEGACACHE_VIEW_BURST": "4"}), "sqlite+fs", args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def _job_seconds(text: str) -> dict[str, float]:
    """megacache_job_seconds_total summed per namespace."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "megacache_job_seconds":
            for s in family.samples:
                ns = s.labels["namespace"]
                out[ns] = out.get(ns, 0.0) + s.value
    return out


def test_one_namespace_flooding_jobs_leaves_anothers_metrics_series(
        fair_server: ServerProcess) -> None:
    """The operator's scrape built ETT series from the 1,000 jobs that reported last across
    all namespaces: a tenant that posted 1,000 one-attempt jobs erased another's series,
    though its own stats still showed its jobs. Each namespace now has its own share."""
    n = os.urandom(3).hex()
    now = time.time()
    calm_ns, flood_ns = f"calm-{n}", f"flood-{n}"
    record = [{"kind": "start", "at": now - 100}, {"kind": "training", "at": now - 90},
              {"kind": "end", "at": now - 1, "reason": "finished"}]
    scrape = token_client(fair_server, "metrics", namespace=calm_ns)
    with token_client(fair_server, "write", namespace=calm_ns) as calm, \
            token_client(fair_server, "write", namespace=flood_ns) as flood, scrape:
        for i in range(7):
            assert calm.post(routes.JOB_PROGRESS.url(job=f"calm-{i}"),
                             json={"attempt": 0, "records": record}).status_code == 202
        before = _job_seconds(scrape.get("/metrics").text)
        assert before.get(calm_ns, 0.0) > 0, before
        for i in range(1000):  # later than every calm job
            answer = flood.post(routes.JOB_PROGRESS.url(job=f"flood-{i}"), json={
                "attempt": 0, "records": [{"kind": "start", "at": time.time() - 5}]})
            assert answer.status_code == 202, answer.text
        after = _job_seconds(scrape.get("/metrics").text)
    assert flood_ns in after, after
    assert after.get(calm_ns) == pytest.approx(before[calm_ns]), (before, after)


def _endpoints(routes_: Sequence[Any], prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(method, path, endpoint) of every route, nested routers included (as
    `route_table.served` walks them)."""
    for route in routes_:
        original = getattr(route, "original_router", None)
        if original is not None:
            context = getattr(route, "include_context", None)
            yield from _endpoints(original.routes, prefix + getattr(context, "prefix", ""))
        elif getattr(route, "endpoint", None) is not None:
            for method in getattr(route, "methods", None) or ():
                yield method, prefix + route.path, route.endpoint


def test_every_get_route_but_a_plain_lookup_is_a_budgeted_view(tmp_path: Path) -> None:
    """A new listing or report cannot skip the view budget (rate per token, its namespace's
    lane, a bounded answer): a GET route that is not a plain lookup must be declared
    `budgeted`; a lookup must not be (it would queue behind its tenant's views)."""
    app = create_app(Settings(data_dir=tmp_path))
    gets = {(m, p): e for m, p, e in _endpoints(app.router.routes) if m == "GET"}
    assert gets.keys() >= PLAIN, PLAIN - gets.keys()
    views = {route for route in gets if route not in PLAIN}
    assert {("GET", "/v1/jobs/{job}/ett"), ("GET", "/v1/ac"), ("GET", "/metrics"),
            ("GET", "/v1/stats"), ("GET", "/v1/dashboard")} <= views
    assert [r for r in sorted(views) if not getattr(gets[r], BUDGETED, False)] == []
    assert [r for r in sorted(PLAIN) if getattr(gets[r], BUDGETED, False)] == []


def test_a_tokens_views_past_its_rate_are_429_and_another_tenant_reads_on(
        fair_server: ServerProcess) -> None:
    """A read token looping over a job's ETT (or any view) gets 429 with Retry-After once
    past its burst; another tenant's views and its own lookups are not held by it."""
    n = os.urandom(3).hex()
    with token_client(fair_server, "read,write", namespace=f"loop-{n}") as loop, \
            token_client(fair_server, "read", namespace=f"other-{n}") as other:
        assert loop.post(routes.JOB_PROGRESS.url(job="j"), json={
            "attempt": 0, "records": [{"kind": "start", "at": time.time() - 5}]}
        ).status_code == 202
        answers = [loop.get("/v1/jobs/j/ett") for _ in range(6)]
        assert [a.status_code for a in answers[:4]] == [200] * 4, answers[0].text
        refused = answers[-1]
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limited"
        assert other.get("/v1/stats").status_code == 200
        assert loop.get(f"/v1/ac/{'0' * 64}").status_code == 404  # a lookup: no budget


def test_a_listing_is_paged_by_bytes_and_the_pages_hold_every_entry(
        fair_server: ServerProcess) -> None:
    """1,000 manifests of ~63 KB made each `GET /v1/ac?limit=1000` 60 MiB. An answer is cut
    at 4 MiB and says where the next page starts (`next_offset`); the pages hold each
    entry once."""
    n = os.urandom(3).hex()
    ns = f"big-{n}"
    keys = set()
    with token_client(fair_server, "read,write", namespace=ns) as c:
        data = os.urandom(100)
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        for i in range(80):
            m = make_manifest({"megacache": data}, make_fingerprint(
                model=f"m{i}", namespace=ns))
            blob = dataclasses.replace(m.blobs[0], meta={f"k{j}": "x" * 4000
                                                          for j in range(14)})
            m = m.replace(blobs=[blob])
            assert len(m.to_json()) > 56_000
            assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
            keys.add(m.key)
        first = c.get("/v1/ac", params={"limit": 1000})
        assert len(first.content) <= 4 * 1024 * 1024 + 1024
        page = first.json()
        cut = page["next_offset"]
        assert 0 < len(page["entries"]) == cut < 80
        rest = c.get("/v1/ac", params={"limit": 1000, "offset": cut}).json()
        assert "next_offset" not in rest
    got = [e["key"] for e in page["entries"] + rest["entries"]]
    assert sorted(got) == sorted(keys)
