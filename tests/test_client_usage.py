"""The client the way people really run torch: real torch.compile, real server, fresh processes.

- every way of compiling (`model.compile()`, a decorator, a plain function, several models in
  one process) gets its own correct key and entry;
- a server that accepts connections and never answers costs each process the load deadline
  (seconds), once per node, with one warning;
- `torchrun --nproc-per-node 4` downloads each blob once per node and publishes once.
A `transformers` model trained with nothing but MEGACACHE_URL set (the entry named by the
client) starting warm on a new machine is the corpus's gpt2 (tests/test_corpus.py).
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess, free_port

from benchmarks.harness.machines import TRAIN_JOB, GxxCounter, JobRun, Machine, run_job

pytestmark = pytest.mark.e2e

need("torch", "the client end-to-end tests run real torch.compile")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def gxx(tmp_path_factory: pytest.TempPathFactory) -> GxxCounter:
    return GxxCounter(tmp_path_factory.mktemp("bin"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server that logs each request, so tests can count downloads and publishes."""
    proc = ServerProcess(tmp_path_factory.mktemp("cache") / "data", log_level="info").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def requests(server: ServerProcess, method: str, path_prefix: str) -> list[str]:
    """The request lines of the server's access log that match, e.g. ("GET", "/v1/cas/")."""
    pattern = re.compile(rf'"{method} ({re.escape(path_prefix)}\S*) HTTP')
    return [m.group(1) for m in pattern.finditer(server.log())]


def run(machine: Machine, gxx: GxxCounter, script: Path, *args: str, env: dict[str, str],
        runner: list[str] | None = None) -> JobRun:
    job = run_job(machine, *args, env=env, gxx=gxx,
                  runner=runner or [sys.executable, str(script)], timeout=600)
    assert job.returncode == 0, job.stderr[-4000:]
    return job


def test_each_compile_style_gets_its_own_key_and_entry(cache, gxx, tmp_path, toolchain):
    """`.compile()` of two models, an EMA copy, a decorated loss and a plain function."""
    job = HERE / "compile_styles_job.py"
    cold = run(Machine(tmp_path / "a", toolchain), gxx, job, env={"MEGACACHE_URL": cache.url})
    tracks = {t["model"]: t for t in cold.result["tracks"]}
    assert sorted(tracks) == ["MLP", "Tower", "loss_fn", "scale"]  # the EMA copy is MLP
    assert len({t["key"] for t in tracks.values()}) == 4
    assert len({t["code"] for t in tracks.values()}) == 4
    assert tracks["loss_fn"]["config"]["fullgraph"] is True
    assert tracks["scale"]["config"]["dynamic"] is False
    assert tracks["MLP"]["config"] == tracks["Tower"]["config"]
    assert all(t["outcome"] == "miss" and t["published"] for t in tracks.values()), tracks
    entries = [httpx.get(f"{cache.url}/v1/ac/{t['key']}").json() for t in tracks.values()]
    assert [e["fingerprint"]["model"] for e in entries] == list(tracks)
    bundles = {next(b["digest"] for b in e["blobs"] if b["role"] == "megacache")
               for e in entries}
    assert len(bundles) == 1  # one process, one Mega-Cache: stored once, four entries

    warm = run(Machine(tmp_path / "b"), gxx, job, env={"MEGACACHE_URL": cache.url})
    again = {t["model"]: t for t in warm.result["tracks"]}
    assert {m: t["key"] for m, t in again.items()} == {m: t["key"] for m, t in tracks.items()}
    assert all(t["outcome"] == "hit" and not t["published"] for t in again.values()), \
        {m: (t["outcome"], t["published"], t.get("reason"), t.get("publish_reason"))
         for m, t in again.items()}
    assert warm.result["counters"]["fxgraph_miss"] == 0
    assert warm.gxx_builds == 0
    assert warm.warnings() == []


@pytest.fixture
def hung_server() -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # accepts connections, never answers
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def breaker_open(node_dir: Path) -> bool:
    """Whether a breaker state file in the node cache dir says a server is marked down."""
    for state in node_dir.glob("breaker/*.json"):
        try:
            if json.loads(state.read_text())["open_until"] > time.time():
                return True
        except (OSError, ValueError, KeyError):
            pass
    return False


HUNG_RANK = """
import json, torch, megacache_client
session = megacache_client.enable(model="hung", code="v1")
double = torch.compile(lambda x: torch.relu(x) * 2)
out = float(double(torch.ones(8)).sum())
session.close()
r = session.load_result
print(json.dumps({"out": out, "megacache": {"outcome": r.outcome, "reason": r.reason,
                  "load_s": r.seconds, "load_steps": r.steps}}))
"""
"""A rank that compiles one small function: the test is about the wait, not the compile."""


def test_hung_server_costs_each_process_the_deadline_once(hung_server, gxx, tmp_path, toolchain):
    """Ranks of one node, default read timeout (30 s) and retries: the two that start
    together each give up within the 3 s load deadline, the first to find out opens the
    node's breaker, and a rank starting after that does not wait at all. Each compiles cold
    with exactly one warning, in seconds, not the read timeout times the retries."""
    deadline = 3.0
    machine = Machine(tmp_path / "node", toolchain)

    def rank(i: int) -> JobRun:
        if i == 2:
            limit = time.monotonic() + 120
            while not breaker_open(machine.root / "node") and time.monotonic() < limit:
                time.sleep(0.2)
        return run(machine, gxx, TRAIN_JOB, runner=[sys.executable, "-c", HUNG_RANK],
                   env={"MEGACACHE_URL": hung_server, "LOCAL_RANK": str(i), "RANK": str(i),
                        "MEGACACHE_LOAD_DEADLINE_S": str(deadline),
                        # long enough that rank 2's start-up (import torch on a busy CI
                        # machine) never outlasts it
                        "MEGACACHE_BREAKER_RESET_S": "600"})

    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(rank, range(3)))
    for r in runs:
        assert r.mc["outcome"] == "error", r.mc
        assert r.result["out"] == 16.0  # compiled cold and ran
        assert len(r.warnings()) == 1 and "compiling cold" in r.warnings()[0], r.stderr
        steps = r.mc["load_steps"]  # time on the server: not fingerprinting, not the
        waited = r.mc["load_s"] - steps["fingerprint"] - steps.get("imports", 0.0)  # imports
        assert waited < deadline + 1.5, r.mc
    assert any("3s load deadline" in r.mc["reason"] for r in runs[:2]), runs[0].mc
    assert "marked down" in runs[2].mc["reason"], runs[2].mc  # the node's breaker was open
    assert runs[2].mc["load_s"] - runs[2].mc["load_steps"]["fingerprint"] < 1.0


TORCHRUN_JOB = HERE / "torchrun_job.py"


def torchrun(machine: Machine, gxx: GxxCounter, url: str) -> list[dict]:
    """A 4-rank job on `machine` (one node); the ranks' results, by rank."""
    results = machine.root / "results"
    results.mkdir()
    runner = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
              "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
              str(TORCHRUN_JOB)]
    job = run_job(machine, env={"MEGACACHE_URL": url, "OMP_NUM_THREADS": "1",
                                "RESULT_DIR": str(results)},
                  gxx=gxx, runner=runner, timeout=900)
    assert job.returncode == 0, job.stderr[-4000:]
    ranks = [json.loads((results / f"rank{i}.json").read_text()) for i in range(4)]
    return [{**r, "gxx_builds": job.gxx_builds} for r in ranks]


def test_torchrun_downloads_once_per_node_and_publishes_once(cache, gxx, tmp_path, toolchain):
    cold = torchrun(Machine(tmp_path / "a", toolchain), gxx, cache.url)
    key = cold[0]["key"]
    assert {r["key"] for r in cold} == {key} and cold[0]["model"] == "TinyNet", cold
    assert [r["outcome"] for r in cold] == ["miss"] * 4, cold
    # one rank publishes: the compile once; its verified precompiled Dynamo entries, when
    # the check ends after a settled point's round, in one more write
    puts = requests(cache, "PUT", f"/v1/ac/{key}")
    why = [(r["rank"], r["published"], r["publish_reason"]) for r in cold]  # on failure
    assert 1 <= len(puts) <= 2 and set(puts) == {f"/v1/ac/{key}"}, (puts, why)
    assert sum(r["published"] for r in cold) == 1, why

    downloads_before = len(requests(cache, "GET", "/v1/cas/"))
    warm = torchrun(Machine(tmp_path / "b"), gxx, cache.url)
    assert [r["outcome"] for r in warm] == ["hit"] * 4, warm
    entry = httpx.get(f"{cache.url}/v1/ac/{key}").json()
    downloads = requests(cache, "GET", "/v1/cas/")[downloads_before:]
    assert sorted(downloads) == sorted(f"/v1/cas/{b['digest']}" for b in entry["blobs"])
    # each blob came down once for the node (the GETs above), by whichever rank took its
    # lock first (the bundle and the header pack may be two ranks'); the others read disk
    assert 1 <= sum(r["bytes_down"] > 0 for r in warm) <= len(entry["blobs"]), warm
    assert warm[0]["gxx_builds"] == 0
    assert requests(cache, "PUT", f"/v1/ac/{key}") == puts  # nothing new: no publish
