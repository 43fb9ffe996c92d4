"""Metrics, the dashboard in a real headless Chromium, and JSON access logs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
from conftest import ensure_tools
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.dashboard_shot import (
    REGENERATE,
    SHOT,
    dump_dom,
    recorded_digest,
    screenshot,
    seed,
    shot_wanted,
    static_digest,
    wait_for_trend,
)


def ensure_chromium() -> None:
    ensure_tools({"chromium": "chromium"})


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample, parsed as Prometheus parses it (label order is free)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not in metrics")


def served_per_worker(metrics_dir: Path) -> dict[str, float]:
    """Lookups answered 200, per worker pid, read from each worker's own counter file."""
    served = {}
    for path in metrics_dir.glob("counter_*.db"):
        for family in MultiProcessCollector.merge([str(path)], accumulate=True):
            for sample in family.samples:
                if sample.name == "megacache_http_requests_total" and \
                        sample.labels.get("route") == "/v1/ac/{key}" and \
                        sample.labels.get("method") == "GET" and \
                        sample.labels.get("status") == "200" and sample.value:
                    served[path.stem.rsplit("_", 1)[1]] = sample.value
    return served


def test_metrics_add_up_across_workers(tmp_path: Path):
    server = ServerProcess(tmp_path / "data", "--workers", "2").start()
    metrics_dir = server.data_dir.resolve() / ".metrics" / str(server.port)  # the workers' own
    try:
        assert metrics_dir.is_dir()
        data = os.urandom(50_000)
        with httpx.Client(base_url=server.url) as c:
            c.put(f"/v1/cas/{sha256(data)}", content=data)
            m = make_manifest({"megacache": data}, make_fingerprint(model="met", code="1"))
            c.put(f"/v1/ac/{m.key}", content=m.to_json())
            lookups = 0  # new connections, until both workers have answered some
            while lookups < 40 or len(served_per_worker(metrics_dir)) < 2:
                assert lookups < 1000, f"not both workers: {served_per_worker(metrics_dir)}"
                assert httpx.get(f"{server.url}/v1/ac/{m.key}").status_code == 200
                lookups += 1
            c.post("/v1/events", json={"key": m.key, "model": "met", "outcome": "hit",
                                       "saved_s": 12.5, "compile_s": 2.0,
                                       "cold_compile_s": 14.5})
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "megacache_http_requests_total", method="GET",
                      route="/v1/ac/{key}", status="200") == lookups
        assert metric(text, "megacache_http_received_bytes_total",
                      route="/v1/cas/{digest}") == 50_000
        assert metric(text, "megacache_runs_total", namespace="default", model="met",
                      outcome="hit") == 1
        assert metric(text, "megacache_compile_saved_seconds_total", namespace="default",
                      model="met") == 12.5
        assert metric(text, "megacache_lookups_total", result="hit") == lookups
        assert metric(text, "megacache_store_bytes") == 50_000
        assert metric(text, "megacache_entries") == 1
        assert "megacache_http_request_duration_seconds_bucket" in text
    finally:
        server.stop()


@pytest.mark.e2e
def test_dashboard_shows_what_the_api_says(tmp_path: Path):
    """Also the one place the README's screenshot is taken: `python -m benchmarks
    dashboard_shot` runs this test with MEGACACHE_DASHBOARD_SHOT set to where it goes."""
    ensure_chromium()
    shot = shot_wanted() or tmp_path / "dashboard.png"
    server = ServerProcess(tmp_path / "data", env={"MEGACACHE_ETT_ROLL_S": "0.5"}).start()
    try:
        seed(server.url)
        wait_for_trend(server.url)
        api = httpx.get(f"{server.url}/v1/dashboard").json()
        dom = dump_dom(server.url + "/", tmp_path / "chromium")
        screenshot(server.url + "/", shot, tmp_path / "chromium")
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom, dom[:2000]
    assert recorded_digest(shot) == static_digest()
    ett = api["ett"]  # the ETT tiles the README describes, filled
    assert ett["jobs"] == 84 and ett["live"] >= 1 and ett["time_to_recover"]["n"] > 0
    tile = re.search(r'data-testid="ett-pct"[^>]*>([^<]*)<', dom)
    assert tile and tile.group(1) == f"{ett['ett_pct']:.1f}%", tile

    def shown(testid: str) -> str:
        found = re.search(rf'data-testid="{testid}"[^>]*>([^<]*)<', dom)
        assert found, testid
        return found.group(1)

    total = api["total"]
    assert shown("total-runs") == str(total["runs"]) and total["runs"] == 168
    assert shown("saved-hours") == f"{total['saved_s'] / 3600:.2f}"
    assert shown("hit-rate") == f"{100 * total['hit_rate']:.1f}%"
    assert shown("entries") == str(api["store"]["entries"]) == "6"
    assert total["mean_tts_s"] and shown("tts") == f"{total['mean_tts_s']:.1f} s"
    for m in api["models"]:
        row = re.search(rf'<tr data-model="{re.escape(m["model"])}">(.*?)</tr>', dom, re.S)
        assert row, m["model"]
        cells = re.findall(r"<td[^>]*>([^<]*)<", row.group(1))
        assert cells[:3] == [m["model"], str(m["runs"]),
                             str(m["outcomes"]["hit"] + m["outcomes"]["fallback"])]
        assert f'data-value="{m["hit_rate"]}"' in row.group(1)
    assert total["restarts"] == 84 and total["tts_p50_s"] and total["ttr_p90_s"]

    def secs(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f} s"

    for m in api["models"]:  # the cache's own figure: process start -> first compiled step
        row = re.search(rf'<tr data-model="{re.escape(m["model"])}">(.*?)</tr>', dom, re.S)
        assert row, m["model"]
        cells = re.findall(r"<td[^>]*>([^<]*)<", row.group(1))
        assert f"{secs(m['tts_p50_s'])} / {secs(m['tts_p90_s'])}" in cells, cells
        assert f"{secs(m['ttr_p50_s'])} / {secs(m['ttr_p90_s'])}" in cells, cells
    assert shown("restarts") == "84"
    assert api["jobs"] and len(api["jobs"]) == 10
    for job in api["jobs"]:
        for a in job["attempts"]:
            row = re.search(rf'<tr data-job="{job["job_id"]}" data-attempt="{a["attempt"]}">'
                            r"(.*?)</tr>", dom, re.S)
            assert row, (job["job_id"], a["attempt"])
            cells = re.findall(r"<td[^>]*>([^<]*)<", row.group(1))
            assert cells[1:5] == [str(a["attempt"]), a["kind"], a["model"],
                                  f"{a['seconds']:.1f} s"]
    for miss in api["top_misses"][:3]:
        assert miss["reason"].replace("'", "&#39;")[:40] in dom.replace("'", "&#39;")
    assert shot.stat().st_size > 10_000


def test_the_committed_screenshot_is_of_the_current_dashboard() -> None:
    """The README's screenshot records the digest of the dashboard files it was taken of:
    a changed dashboard with an old screenshot fails here, fast (no browser)."""
    recorded = recorded_digest(SHOT)
    assert recorded == static_digest(), (
        f"{SHOT.relative_to(SHOT.parents[2])} was taken of other dashboard files "
        f"(recorded {recorded}, now {static_digest()}): regenerate it with `{REGENERATE}` "
        "(runs the browser test that takes it; needs chromium) and commit it")


def test_json_access_log(tmp_path: Path):
    server = ServerProcess(tmp_path / "data", "--log-format", "json",
                           log_level="info").start()
    try:
        r = httpx.get(f"{server.url}/v1/ac/{'0' * 64}", headers={"x-request-id": "req-123"})
        assert r.headers["x-request-id"] == "req-123"
        assert httpx.get(f"{server.url}/healthz").headers["x-request-id"]
    finally:
        server.stop()
    lines = [json.loads(ln) for ln in server.log().splitlines() if ln.startswith("{")]
    access = [ln for ln in lines if ln["logger"] == "megacache.access"]
    hit = next(ln for ln in access if ln.get("request_id") == "req-123")
    assert hit["route"] == "/v1/ac/{key}" and hit["status"] == 404
    assert hit["duration_ms"] >= 0 and hit["bytes_out"] > 0 and hit["method"] == "GET"


@pytest.mark.parametrize("fmt", ["text"])
def test_text_logs_stay_plain(tmp_path: Path, fmt: str):
    server = ServerProcess(tmp_path / "data", "--log-format", fmt, log_level="info").start()
    httpx.get(f"{server.url}/healthz")
    server.stop()
    assert '"GET /healthz HTTP/1.1" 200' in server.log()
