"""#58: no read costs another tenant, no tenant erases another's view: the operator's
`/metrics` gives each namespace its own share of jobs, and every read that can cost more
than a lookup is budgeted (`service.views`), which the route table is held to."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from conftest import _configured, backend_args
from helpers import ServerProcess, token_client
from prometheus_client.parser import text_string_to_metric_families

from megacache_client.wire import routes


@pytest.fixture(scope="module")
def fair_server(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args, env = backend_args("sqlite+fs", request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("fair") / "data", *args, "--auth",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_PROGRESS_RATE": "100000",
             "MEGACACHE_PROGRESS_BURST": "100000"}), "sqlite+fs", args).start()
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
