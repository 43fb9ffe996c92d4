"""The operators' monitoring kit in docker/: the Grafana dashboard asks only for series a
real server exports (after traffic of every kind: lookups, uploads, job attempts), and the
compose file's monitoring profile provisions Prometheus (scraping the servers) and Grafana
(with that dashboard) from the files in the repository."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import pytest
import yaml
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256
from prometheus_client.parser import text_string_to_metric_families
from test_docker import tool

DOCKER = Path(__file__).resolve().parent.parent / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "megacache.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label
    matchers, ranges, `by (...)` groupings and function names are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ",
                  expr)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL query of the dashboard: panel targets and query variables."""
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append(re.sub(r"^label_values\((.*?)(,\s*\w+)?\)$", r"\1", q))
    return found


def test_metric_names_are_found_in_promql():
    assert metric_names('histogram_quantile(0.9, sum by (le, model) (max by (le, namespace) '
                        '(increase(a_bucket{namespace=~"x|y", le!="1"}[$window]))))') == \
        {"a_bucket"}
    assert metric_names("max(b_bytes) / sum(c_total offset 1h) > bool 0") == \
        {"b_bytes", "c_total"}


def exported_after_traffic(tmp_path: Path) -> set[str]:
    """Sample names of a real server's /metrics after uploads, lookups and job runs."""
    server = ServerProcess(tmp_path / "data", "--store-budget", "1GiB").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            data = b"x" * 10_000
            assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
            m = make_manifest({"megacache": data}, make_fingerprint(model="mon"))
            assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
            assert c.get(f"/v1/ac/{m.key}").status_code == 200
            assert c.get(f"/v1/ac/{'0' * 64}").status_code == 404
            for attempt, outcome in ((0, "miss"), (1, "hit")):
                for rank in range(2):
                    r = c.post("/v1/events", json={
                        "key": m.key, "model": "mon", "outcome": outcome, "compile_s": 5.0,
                        "saved_s": 3.0 if outcome == "hit" else 0.0, "cold_compile_s": 9.0,
                        "tts_s": 20.0 + rank, "job_id": "job-1", "attempt": attempt,
                        "rank": rank, "world_size": 2})
                    assert r.status_code == 202, r.text
            now = time.time()  # job-1's progress: a failed attempt 0 with a checkpoint
            for attempt, records in enumerate((
                    [{"kind": "start", "at": now - 600}, {"kind": "training", "at": now - 560},
                     {"kind": "checkpoint_save", "at": now - 500, "step": 10,
                      "blocking_s": 3.0}, {"kind": "heartbeat", "at": now - 400, "step": 20}],
                    [{"kind": "start", "at": now - 300}, {"kind": "training", "at": now - 250},
                     {"kind": "heartbeat", "at": now - 10, "step": 40}])):
                r = c.post("/v1/jobs/job-1/progress", json={"attempt": attempt,
                                                            "records": records})
                assert r.status_code == 202, r.text
            text = c.get("/metrics").text
    finally:
        server.stop()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_dashboard_query_names_an_exported_series(tmp_path: Path):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    wanted = set().union(*(metric_names(e) for e in exprs))
    assert all(metric_names(e) for e in exprs), [e for e in exprs if not metric_names(e)]
    for needed in ("megacache_job_time_to_start_seconds_bucket",
                   "megacache_job_time_to_recover_seconds_bucket",
                   "megacache_job_restarts_total", "megacache_compile_saved_seconds_total",
                   "megacache_runs_total", "megacache_http_requests_total",
                   "megacache_http_request_duration_seconds_bucket", "megacache_store_bytes",
                   "megacache_replays_total", "megacache_job_seconds_total",
                   "megacache_checkpoint_blocking_seconds_bucket",
                   "megacache_job_lost_seconds_bucket", "megacache_job_failures_total",
                   "megacache_job_start_component_seconds_total"):
        assert needed in wanted  # what the dashboard is for
    exported = exported_after_traffic(tmp_path)
    assert wanted <= exported, sorted(wanted - exported)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]


def test_the_monitoring_profile_provisions_prometheus_and_grafana():
    cmd = [tool("docker-compose"), "-f", str(DOCKER / "compose.yaml"),
           "--profile", "scale", "--profile", "monitoring"]
    config = json.loads(subprocess.run(cmd + ["config", "--format", "json"], check=True,
                                       capture_output=True, text=True).stdout)
    services = config["services"]
    assert {"prometheus", "grafana", "replica-1", "replica-2"} <= set(services)
    mounts = {s: {v["target"]: Path(v["source"]) for v in services[s]["volumes"]
                  if v["type"] == "bind"} for s in ("prometheus", "grafana")}
    for target, source in [*mounts["prometheus"].items(), *mounts["grafana"].items()]:
        if not target.endswith("metrics-token"):  # the operator's file (docs)
            assert source.exists(), source
            assert source.resolve().is_relative_to(DOCKER.resolve())

    prom = yaml.safe_load(mounts["prometheus"]["/etc/prometheus/prometheus.yml"].read_text())
    [job] = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["credentials_file"] in mounts["prometheus"]
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    assert {"megacache:8787", "replica-1:8787", "replica-2:8787"} == targets
    # ETT's rules (tests/test_alerts.py) are loaded from the file the repository holds
    [rules] = prom["rule_files"]
    assert mounts["prometheus"][rules].resolve() == (DOCKER / "prometheus" /
                                                     "megacache.rules.yml").resolve()

    provisioning = mounts["grafana"]["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text()
                              )["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "megacache.yaml").read_text()
                                )["providers"]
    # Grafana loads, and opens first, the very dashboard the tests above check
    dashboards = mounts["grafana"][provider["options"]["path"]]
    assert dashboards.resolve() == DASHBOARD.parent.resolve(), dashboards
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).parent == PurePosixPath(provider["options"]["path"]), home
    assert (dashboards / PurePosixPath(home).name).resolve() == DASHBOARD.resolve(), home


@pytest.mark.parametrize("path", sorted((DOCKER / "grafana").rglob("*.json")))
def test_dashboards_are_grafana_json(path: Path):
    dashboard = json.loads(path.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["type"] == "prometheus" and panel["targets"]
