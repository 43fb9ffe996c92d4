"""A job that fails and restarts, as Effective Training Time counts it: one start, one
recovery, whatever the number of ranks.

A real `torchrun --nproc-per-node 2 --max-restarts 1` whose rank 0 fails after its first
step in attempt 0 (tests/restart_job.py), against a real server: attempt 1 resolves the key
afresh and starts warm from what attempt 0 published; the job's figures in `/v1/jobs`,
`/v1/stats`, `/metrics` and the dashboard (in headless Chromium) count the job once per
attempt, not once per rank.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ensure_tools, need
from helpers import ServerProcess, free_port
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.dashboard_shot import dump_dom
from benchmarks.harness.machines import GxxCounter, Machine, run_job

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("restart") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def test_a_restart_resolves_afresh_and_counts_as_one_recovery(cache: ServerProcess,
                                                              tmp_path: Path):
    """The job's node is new (no toolchain built): the recovery's time to start is held
    below the start's, which then includes the cold start a new machine has."""
    need("torch", "the job compiles a real model")
    job = f"restart-{tmp_path.name[-12:]}".replace("_", "-")
    results = tmp_path / "results"
    results.mkdir()
    runner = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--max-restarts", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", job,
              str(HERE / "restart_job.py")]
    run = run_job(Machine(tmp_path / "node"), env={
        "MEGACACHE_URL": cache.url, "MEGACACHE_JOB_ID": job, "OMP_NUM_THREADS": "1",
        "RESULT_DIR": str(results)}, gxx=GxxCounter(tmp_path / "bin"), runner=runner,
        timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]  # attempt 1 succeeded
    assert "simulated failure after the first step of attempt 0" in run.stderr
    seen = {(r["rank"], r["attempt"]): r for r in
            (json.loads(p.read_text()) for p in results.glob("rank*-attempt*.json"))}
    assert seen[(0, 0)]["outcome"] == "miss", seen  # the job's first look: nothing yet
    for rank in (0, 1):  # the restart looks again, and finds what attempt 0 published
        assert seen[(rank, 1)]["outcome"] == "hit", seen
        assert f"job {job} attempt 1" in seen[(rank, 1)]["reason"], seen

    listed = httpx.get(f"{cache.url}/v1/jobs", timeout=30).json()["jobs"]
    record = next(j for j in listed if j["job_id"] == job)
    attempts = {a["attempt"]: a for a in record["attempts"]}
    assert sorted(attempts) == [0, 1] and record["restarts"] == 1, record
    assert (attempts[0]["kind"], attempts[1]["kind"]) == ("start", "recover"), attempts
    assert attempts[1]["reports"] == 2 and attempts[1]["outcome"] == "hit", attempts
    assert attempts[1]["seconds"] < attempts[0]["seconds"], attempts  # recovered warm

    model = next(m for m in httpx.get(f"{cache.url}/v1/stats", timeout=30).json()["models"]
                 if m["model"] == "TinyNet")
    assert (model["tts_n"], model["ttr_n"], model["restarts"]) == (1, 1, 1), model
    assert model["ttr_p50_s"] < model["tts_p50_s"], model

    metrics = httpx.get(f"{cache.url}/metrics", timeout=30).text
    for name, attempts_counted in (("megacache_run_first_step_seconds", 1),
                                   ("megacache_rerun_first_step_seconds", 1)):
        buckets = [(float(s.labels["le"]), s.value)
                   for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == f"{name}_bucket" and s.labels.get("model") == "TinyNet"]
        counts = [v for _, v in sorted(buckets)]
        assert counts and counts == sorted(counts) and counts[-1] == attempts_counted, buckets
        count = [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                 if s.name == f"{name}_count" and s.labels.get("model") == "TinyNet"]
        assert count == [attempts_counted], (name, count)

    ensure_tools({"chromium": "chromium"})
    dom = dump_dom(cache.url + "/", tmp_path / "chromium")
    assert 'data-loaded="true"' in dom, dom[:2000]
    for attempt, kind in ((0, "start"), (1, "recover")):
        row = re.search(rf'<tr data-job="{job}" data-attempt="{attempt}">(.*?)</tr>', dom, re.S)
        assert row, (job, attempt)
        cells = re.findall(r"<td[^>]*>([^<]*)<", row.group(1))
        assert cells[1:4] == [str(attempt), kind, "TinyNet"], cells
