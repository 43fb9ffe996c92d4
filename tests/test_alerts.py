"""ETT's Prometheus rules (#60): docker/prometheus/megacache.rules.yml, shipped with the
compose monitoring profile and, the same, in docker/k8s/prometheus-rules.yaml.

- `promtool check rules` passes and `promtool test rules` runs the rules' unit tests
  (docker/prometheus/megacache.rules.test.yml: each alert fires on its case, not on the
  case beside it, and two replicas exporting the same figures count once);
- every series the rules read is one a real server exports;
- end to end: a real Prometheus scrapes a real server while a real job trains (zero-code)
  and `MegacacheEttLow` fires (the test's copy of the rules evaluates every second and
  waits for nothing: `for: 0s`, else the same expressions).

promtool and prometheus come from Debian's `prometheus` package, installed by the suite's
set-up as root (`conftest.ensure_tools`); missing, the tests fail in CI.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import ensure_tools, need
from helpers import ServerProcess, free_port
from test_monitoring import exported_after_traffic, metric_names

from benchmarks.harness import ETT_CAUSES_JOB
from benchmarks.harness.machines import Machine, clean_env

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docker" / "prometheus" / "megacache.rules.yml"
RULE_TESTS = RULES.with_name("megacache.rules.test.yml")
K8S_RULES = ROOT / "docker" / "k8s" / "prometheus-rules.yaml"
TOOLS = {"promtool": "prometheus", "prometheus": "prometheus"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    ensure_tools(TOOLS)
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=300,
                          cwd=RULES.parent)


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0 and "SUCCESS: 10 rules found" in checked.stdout, checked
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", [])
             if a["exp_alerts"]}
    assert fired == alerts == {"MegacacheEttLow", "MegacacheFailureCauseRising",
                               "MegacacheWarmStartRateDropping",
                               "MegacacheTimeToStartRegressing"}


def test_kubernetes_ships_the_same_rules() -> None:
    (doc,) = [d for d in yaml.safe_load_all(K8S_RULES.read_text()) if d]
    assert doc["kind"] == "ConfigMap"
    assert doc["data"]["megacache.rules.yml"] == RULES.read_text()


def test_the_rules_read_only_series_a_server_exports(tmp_path: Path) -> None:
    exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"]
             for r in g["rules"]]
    recorded = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"]
                for r in g["rules"] if "record" in r}
    wanted = set().union(*(metric_names(e) for e in exprs)) - recorded
    assert {"megacache_job_failures_total", "megacache_job_ett_percent",
            "megacache_runs_total", "megacache_model_time_to_start_seconds"} <= wanted
    assert wanted <= exported_after_traffic(tmp_path), wanted


def fast(rules: str) -> str:
    """The rules evaluated every second, an alert firing as soon as its expression holds."""
    return re.sub(r"(?m)^(\s*)for: .*$", r"\1for: 0s",
                  re.sub(r"(?m)^(\s*)interval: .*$", r"\1interval: 1s", rules))


@pytest.mark.e2e
def test_a_real_prometheus_scraping_a_real_server_fires_while_a_job_runs(
        tmp_path: Path) -> None:
    need("torch", "the job is a real trainer")
    ensure_tools(TOOLS)
    server = ServerProcess(tmp_path / "data").start()
    port = free_port()
    (tmp_path / "rules.yml").write_text(fast(RULES.read_text()))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yml")],
        "scrape_configs": [{"job_name": "megacache", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [server.url.split("//")[1]]}]}]}))
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"),  # noqa: SIM115
        start_new_session=True)
    machine = Machine(tmp_path / "node")
    (tmp_path / "truth").mkdir()
    (tmp_path / "ckpt").mkdir()
    job = subprocess.Popen(
        [sys.executable, str(ETT_CAUSES_JOB)],
        env={**clean_env(), **machine.env(), "MEGACACHE_URL": server.url, "RUN": "1",
             "OMP_NUM_THREADS": "1", "MEGACACHE_MODE": "read-only", "STEPS": "100",
             "CKPT_EVERY": "50", "FAIL_AT": "0", "STEP_S": "0.1",
             "TRUTH_DIR": str(tmp_path / "truth"), "CKPT_DIR": str(tmp_path / "ckpt")},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}/api/v1"
    fired: list[dict[str, object]] = []
    try:
        deadline = time.monotonic() + 120
        while not fired and time.monotonic() < deadline:
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
            try:
                alerts = httpx.get(f"{api}/alerts", timeout=5).json()["data"]["alerts"]
            except (httpx.HTTPError, ValueError):
                continue  # not up yet
            fired = [a for a in alerts if a["labels"]["alertname"] == "MegacacheEttLow"
                     and a["state"] == "firing"]
        training = job.poll() is None  # the job was still running when the alert fired
        scraped = httpx.get(f"{api}/query", params={
            "query": 'megacache_job_failures_total{cause="preempted"}'}, timeout=5).json()
    finally:
        for proc in (job, prometheus):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        server.stop()
    assert fired, (tmp_path / "prometheus.log").read_text()[-3000:]
    assert fired[0]["labels"]["namespace"] == "default", fired  # type: ignore[index]
    assert float(fired[0]["value"]) < 80, fired  # type: ignore[arg-type]
    assert training, "the job ended before the alert fired: nothing shows it fires live"
    assert scraped["data"]["result"], scraped  # a cause's series, scraped from the server
