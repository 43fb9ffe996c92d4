"""The client in real training processes: real torch.compile, a real server, fresh "machines".

A machine here is a fresh set of TORCHINDUCTOR_CACHE_DIR, TMPDIR (precompiled headers) and
node-local blob cache. g++ runs through a logging wrapper on PATH so a test can assert that
a warm start compiled no kernels. Processes that test failure paths reuse the producer's
local torch caches: they only have to show the trainer completes, and that keeps CI short.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess, free_port

from benchmarks.harness.machines import TRAIN_JOB, GxxCounter, JobRun, Machine, clean_env, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("torch_s_own_compile_threads")]

need("torch", "the client end-to-end tests run real torch.compile")

ROOT = Path(__file__).resolve().parent.parent
MODEL, CODE = "tiny-mlp", "v1"


@pytest.fixture(scope="module")
def gxx(tmp_path_factory: pytest.TempPathFactory) -> GxxCounter:
    return GxxCounter(tmp_path_factory.mktemp("bin"))


def run_on(machine: Machine, gxx: GxxCounter, *args: str, url: str | None = None,
           extra_env: dict[str, str] | None = None, runner: list[str] | None = None,
           check: bool = True) -> JobRun:
    env = {"MEGACACHE_URL": url} if url else {}
    env.update(extra_env or {})
    job = run_job(machine, *args, env=env, gxx=gxx, runner=runner, timeout=300)
    if check and job.returncode != 0:
        raise AssertionError(f"job failed ({job.returncode}):\n{job.stderr[-4000:]}")
    return job


def job_args(*extra: str, name: str = MODEL, code: str = CODE) -> list[str]:
    return ["--model", "mlp", "--steps", "2", "--megacache", "explicit", "--name", name,
            "--code", code, *extra]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("cache") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def producer(cache: ServerProcess, gxx: GxxCounter, tmp_path_factory: pytest.TempPathFactory,
             toolchain: Path) -> tuple[Machine, JobRun]:
    """Machine A compiles cold and publishes (on a node whose toolchain is built: what it
    ships a new machine is what the tests below examine)."""
    machine = Machine(tmp_path_factory.mktemp("machine-a"), toolchain)
    run = run_on(machine, gxx, *job_args(), url=cache.url)
    assert run.mc["outcome"] == "miss", run.mc
    assert run.mc["published"], run.mc
    assert run.gxx_builds > 0  # it really compiled kernels
    return machine, run


def test_new_machine_starts_warm(cache, producer, gxx, tmp_path):
    _, cold = producer
    run = run_on(Machine(tmp_path / "b"), gxx, *job_args(), url=cache.url)
    assert run.mc["outcome"] == "hit", run.mc
    # FX graph hits; with precompiled Dynamo output (on by default, verified entries) there
    # are no FX lookups at all.
    assert run.result["counters"]["fxgraph_hit"] > 0 or run.result["precompile_hit"] > 0
    assert run.result["counters"]["fxgraph_miss"] == 0
    assert run.result["counters"]["aot_miss"] == 0
    assert run.gxx_builds == 0, "a warm start must not build kernels or headers"
    assert run.mc["placed"]["kernels"] > 0 and run.mc["placed"]["toolchain"] > 0
    assert run.mc["bytes_down"] > 0
    assert run.mc["saved_s"] > 0
    assert not run.mc["published"]  # nothing new to add
    assert run.result["loss"] == pytest.approx(cold.result["loss"])
    assert run.warnings() == []
    models = {m["model"]: m for m in httpx.get(cache.url + "/v1/stats").json()["models"]}
    assert models[MODEL]["outcomes"]["hit"] >= 1
    assert models[MODEL]["saved_s"] > 0


def test_two_local_ranks_download_once(cache, producer, gxx, tmp_path):
    shared_node = tmp_path / "node"
    machines = [Machine(tmp_path / f"rank{i}") for i in range(2)]

    def rank(i: int) -> JobRun:
        return run_on(machines[i], gxx, *job_args(), url=cache.url,
                       extra_env={"LOCAL_RANK": str(i), "RANK": str(i),
                                  "MEGACACHE_NODE_CACHE_DIR": str(shared_node)})

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(rank, range(2)))
    assert [r.mc["outcome"] for r in runs] == ["hit", "hit"]
    entry = httpx.get(f"{cache.url}/v1/ac/{runs[0].mc['entry_key']}").json()
    total = sum(b["size"] for b in entry["blobs"])
    assert sum(r.mc["bytes_down"] for r in runs) == total  # prefetch may split it
    # every rank may publish, and none has anything the entry lacks: a rank whose
    # precompiled Dynamo output loaded compiled nothing (torch recorded nothing at all)
    nothing_lacking = {"the loaded entry already has every graph this run compiled",
                       "torch recorded no cache artifacts"}
    assert all(r.mc["publish_reason"] in nothing_lacking for r in runs), [
        r.mc["publish_reason"] for r in runs]
    assert [r.mc["published"] for r in runs] == [False, False]
    assert [r.mc["bytes_up"] for r in runs] == [0, 0]


def test_changed_code_falls_back_and_names_the_component(cache, producer, gxx, tmp_path):
    run = run_on(Machine(tmp_path / "c"), gxx, *job_args(code="v2"), url=cache.url)
    assert run.mc["outcome"] == "fallback", run.mc
    assert run.mc["differing"] == ["code"]
    c = run.result["counters"]  # the model's graphs did not change: they come from the cache
    assert c["fxgraph_hit"] + c["aot_hit"] > 0 and c["fxgraph_miss"] == 0, c
    assert run.mc["published"]  # the new code gets its own entry
    machine, _ = producer
    miss = run_on(machine, gxx, *job_args(code="v3"), url=cache.url,
                   extra_env={"MEGACACHE_FALLBACK": "0"})
    assert miss.mc["outcome"] == "miss"
    assert "code" in miss.mc["differing"]
    assert "code (" in miss.mc["reason"], miss.mc["reason"]


def test_corrupt_blob_is_rejected_before_torch_sees_it(cache, producer, gxx, tmp_path):
    entry_key = producer[1].mc["key"]
    entry = httpx.get(f"{cache.url}/v1/ac/{entry_key}").json()
    bundle = next(b for b in entry["blobs"] if b["role"] == "megacache")
    path = cache.data_dir / "cas" / bundle["digest"][:2] / bundle["digest"]
    original = path.read_bytes()
    try:
        path.write_bytes(original[:100] + bytes(b ^ 0xFF for b in original[100:200])
                         + original[200:])  # same size, different bytes: bit rot on disk
        machine, _ = producer
        fresh_node = {"MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "node")}
        run = run_on(machine, gxx, *job_args(), url=cache.url, extra_env=fresh_node)
    finally:
        path.write_bytes(original)
    assert run.mc["outcome"] == "invalid", run.mc
    assert "corrupt" in run.mc["reason"]
    assert run.result["loss"] > 0  # the trainer completed its steps
    assert len(run.warnings()) == 1, run.stderr
    # the server re-hashed the reported blob and quarantined it: this run's clean bundle
    # replaces the entry (a load that failed for any other reason publishes nothing)
    assert run.mc["published"], run.mc["publish_reason"]
    models = {m["model"]: m for m in httpx.get(cache.url + "/v1/stats").json()["models"]}
    assert models[MODEL]["outcomes"]["invalid"] >= 1


@pytest.mark.parametrize("where", ["down", "hanging"])
def test_unreachable_server_never_hurts_the_trainer(producer, gxx, where, hanging_server):
    url = f"http://127.0.0.1:{free_port()}" if where == "down" else hanging_server
    machine, _ = producer
    started = time.monotonic()
    run = run_on(machine, gxx, *job_args(), url=url,
                  extra_env={"MEGACACHE_READ_TIMEOUT_S": "1", "MEGACACHE_CONNECT_TIMEOUT_S": "1"})
    assert run.returncode == 0
    assert run.mc["outcome"] == "error", run.mc
    assert run.result["loss"] > 0
    assert len(run.warnings()) == 1, run.stderr
    assert "compiling cold" in run.warnings()[0]
    assert time.monotonic() - started < 120


def test_required_mode_raises(producer, gxx):
    machine, _ = producer
    run = run_on(machine, gxx, *job_args(), url=f"http://127.0.0.1:{free_port()}",
                  extra_env={"MEGACACHE_MODE": "required", "MEGACACHE_RETRIES": "0"},
                  check=False)
    assert run.returncode != 0
    assert "MegacacheError" in run.stderr


def test_zero_code_autoload(cache, producer, gxx, tmp_path):
    """The .pth hook enables the client from MEGACACHE_* alone: no code change in the job."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(ROOT / "megacache_autoload.pth", site_dir)
    # site.addsitedir processes .pth files exactly as interpreter start-up does for
    # site-packages (where a wheel install puts this file).
    runner = [sys.executable, "-c",
              f"import site, runpy, sys; site.addsitedir({str(site_dir)!r}); "
              f"sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
              str(TRAIN_JOB)]
    run = run_on(Machine(tmp_path / "z"), gxx, "--model", "mlp", "--steps", "2",
                  "--megacache", "env", url=cache.url, runner=runner,
                  extra_env={"MEGACACHE_MODEL": MODEL, "MEGACACHE_CODE": CODE})
    assert run.mc["outcome"] == "hit", run.mc
    assert run.gxx_builds == 0


def _toolchain(cache: ServerProcess, key: str) -> dict:
    entry = httpx.get(f"{cache.url}/v1/ac/{key}").json()
    return next(b for b in entry["blobs"] if b["role"] == "toolchain")


def test_pgo_profile_travels_in_the_bundle(cache, producer, gxx, tmp_path):
    """Two input shapes: the producer compiles static then dynamic; a consumer goes dynamic.

    The second cold producer on this env + hw also reuses the stored precompiled header
    instead of uploading its own ~21 MB copy.
    """
    args = job_args("--shapes", "varying", "--steps", "3", name="pgo-mlp")
    producer_b = run_on(Machine(tmp_path / "p"), gxx, *args, url=cache.url)
    assert producer_b.result["frames"] == 2, producer_b.result
    first_toolchain = _toolchain(cache, producer[1].mc["key"])
    assert _toolchain(cache, producer_b.mc["key"]) == first_toolchain
    assert producer_b.mc["bytes_up"] < first_toolchain["size"]
    consumer = run_on(Machine(tmp_path / "c"), gxx, *args, url=cache.url)
    assert consumer.mc["outcome"] == "hit"
    # Straight to the dynamic graph; with precompiled Dynamo output, no tracing at all.
    assert consumer.result["frames"] <= 1, consumer.result
    assert consumer.result["counters"]["fxgraph_miss"] == 0
    assert consumer.result["counters"]["fxgraph_hit"] > 0 or consumer.result["precompile_hit"]


def test_server_stopped_mid_run(producer, gxx, tmp_path):
    """The server dies after the job loaded (missed) and before it publishes: one warning."""
    server = ServerProcess(tmp_path / "data", log_level="info").start()
    machine, _ = producer
    # No prefetch: its listing at enable would trip the kill below before the load ran.
    env = {**machine.env(), "MEGACACHE_URL": server.url, "MEGACACHE_PREFETCH": "0"}
    env.update(gxx.env(tmp_path / "gxx.log"))
    cmd = [sys.executable, str(TRAIN_JOB), *job_args(code="mid-run", name="mid-run")]
    full_env = {**clean_env(), **env}
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while "GET /v1/ac?" not in server.log() and time.monotonic() < deadline:  # loaded
            time.sleep(0.05)
        server.kill()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        server.stop()
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["loss"] > 0
    assert result["megacache"]["outcome"] == "miss"
    assert not result["megacache"]["published"]
    # the exit's round probes the server before building anything (#56): a server that
    # is gone costs neither the packs nor the precompile check
    assert "unreachable: nothing built" in result["megacache"]["publish_reason"]
    assert len([ln for ln in err.splitlines() if ln.startswith("megacache:")]) == 1, err
