"""Every rank warm (#57): ranks that compile different things each keep their compile, ranks
that compile the same thing upload it once, and no rank runs another rank's code.

Real torchrun jobs of two ranks over gloo (`stage_job.py`, zero-code, default settings),
against a real server:
- a stage job (each rank its own layers) whose rank 1 is SIGKILLed in attempt 0 once its
  compile is published; attempt 1 runs on new machines (fresh caches for every rank):
  every rank starts warm (no FX graph or AOTAutograd miss, no g++ build), with the losses
  of the cold attempt;
- data-parallel ranks (the same stage on both): one rank uploads, the other nothing;
- a function whose graph Dynamo specialises on `dist.get_rank()` without a guard, compiled
  and published by rank 0 only: on a new machine rank 1 compiles its own (a miss), never
  runs rank 0's, and gets its own values.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import need
from helpers import ServerProcess, free_port

from benchmarks.harness import STAGE_JOB
from benchmarks.harness.machines import GxxCounter, Machine, clean_env

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = ServerProcess(tmp_path_factory.mktemp("ranks") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()[-3000:]


def torchrun(server: ServerProcess, tmp: Path, name: str, *, restarts: int = 0,
             machine: Machine | None = None, toolchain: Path | None = None,
             **env: str) -> subprocess.CompletedProcess[str]:
    """A 2-rank job of stage_job.py; results in tmp/results. Without `machine`, each
    attempt and rank runs on a new machine of its own (under tmp/machines); `toolchain`:
    the first attempt's start with torch's toolchain built (they produce, nothing more)."""
    (tmp / "results").mkdir(parents=True, exist_ok=True)
    if machine is None and toolchain is not None:
        for rank in (0, 1):
            Machine(tmp / "machines" / "attempt0" / f"rank{rank}", toolchain)
    gxx = GxxCounter(tmp / "bin")
    full = clean_env() | gxx.env(tmp / "gxx-unused.log") | {
        "MEGACACHE_URL": server.url, "MEGACACHE_MODEL": name, "OMP_NUM_THREADS": "1",
        "RESULT_DIR": str(tmp / "results"), "PYTHONPATH": str(HERE)} | env
    if machine is not None:
        full |= machine.env()
    else:
        full["MACHINES"] = str(tmp / "machines")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "--monitor-interval", "0.1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--rdzv-id", f"{name}-{time.monotonic_ns()}", str(STAGE_JOB)]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900)


def result(tmp: Path, rank: int, attempt: int = 0) -> dict[str, Any]:
    return dict(json.loads((tmp / "results" / f"rank{rank}-attempt{attempt}.json").read_text()))


def builds(tmp: Path, attempt: int, rank: int) -> int:
    return GxxCounter.builds(tmp / "machines" / f"attempt{attempt}" / f"rank{rank}" /
                             "gxx.log")


def unique(tmp: Path) -> str:
    return f"{tmp.name[-10:]}-{int(time.time() * 1000) % 10**8}".replace("_", "-")


def test_every_stage_starts_warm_after_one_stage_is_killed(server: ServerProcess,
                                                           tmp_path: Path,
                                                           toolchain: Path) -> None:
    need("torch", "the job compiles real models")
    done = torchrun(server, tmp_path, f"stages-{unique(tmp_path)}", restarts=1,
                    toolchain=toolchain, KILL_RANK="1")
    assert done.returncode == 0, done.stderr[-5000:]
    assert "rank 1 killed after step 1" in done.stderr, done.stderr[-3000:]
    cold = {rank: result(tmp_path, rank, 0)["losses"] for rank in (0, 1)}  # its first steps
    assert builds(tmp_path, 0, 0) > 0 and builds(tmp_path, 0, 1) > 0  # both compiled cold
    for rank in (0, 1):  # the restart, every rank on a new machine
        warm = result(tmp_path, rank, 1)
        c = warm["counters"]
        assert warm["outcome"] == "hit", warm
        assert c["fxgraph_miss"] == 0 and c["aot_miss"] == 0, (rank, warm)
        assert c["fxgraph_hit"] + c["aot_hit"] + warm["precompile_hit"] >= 1, (rank, warm)
        assert builds(tmp_path, 1, rank) == 0, (rank, warm)
    for rank in (0, 1):
        warm = result(tmp_path, rank, 1)["losses"]
        assert cold[rank] and warm[:len(cold[rank])] == cold[rank], (rank, cold, warm)
    # both stages' `model.compile()` is one precompile key (`Module._call_impl`): the
    # bundle holds one rank's package, and only that rank may install it
    assert sum(result(tmp_path, r, 1)["precompile_hit"] > 0 for r in (0, 1)) <= 1


def test_data_parallel_ranks_upload_once(server: ServerProcess, tmp_path: Path,
                                        toolchain: Path) -> None:
    need("torch", "the job compiles real models")
    node = Machine(tmp_path / "node", toolchain)  # both ranks on one node, as DP ranks are
    done = torchrun(server, tmp_path, f"same-{unique(tmp_path)}", machine=node, STAGES="same")
    assert done.returncode == 0, done.stderr[-5000:]
    ranks = [result(tmp_path, rank) for rank in (0, 1)]
    uploaders = [r for r in ranks if r["bytes_up"] > 0]
    assert len(uploaders) == 1, [(r["rank"], r["publish_reason"], r["bytes_up"]) for r in ranks]
    other = next(r for r in ranks if r["bytes_up"] == 0)
    assert other["publish_reason"].endswith("already has everything this run compiled"), other


def test_a_rank_specific_graph_is_a_miss_never_another_ranks(server: ServerProcess,
                                                             tmp_path: Path,
                                                             toolchain: Path) -> None:
    """Rank 0 alone publishes `x * (get_rank() + 1) + 1`; on new machines rank 1 must not
    run rank 0's precompiled Dynamo output (its guards do not cover the rank) nor its
    graph, and gets x * 2 + 1."""
    need("torch", "the job compiles real models")
    name = f"rankconst-{unique(tmp_path)}"
    cold = torchrun(server, tmp_path / "cold", name, STAGES="rank_constant",
                    toolchain=toolchain, READ_ONLY_RANKS="1")
    assert cold.returncode == 0, cold.stderr[-5000:]
    want = {rank: result(tmp_path / "cold", rank)["losses"] for rank in (0, 1)}
    assert want[1] == [4 * (2 * s + 1) for s in range(3)], want
    new = torchrun(server, tmp_path / "new", name, STAGES="rank_constant")
    assert new.returncode == 0, new.stderr[-5000:]
    zero, one = result(tmp_path / "new", 0), result(tmp_path / "new", 1)
    assert zero["outcome"] == one["outcome"] == "hit", (zero, one)
    assert zero["losses"] == want[0] and one["losses"] == want[1], (zero, one)
    assert one["precompile_hit"] == 0 and one["counters"]["fxgraph_miss"] >= 1, one
    assert zero["counters"]["fxgraph_miss"] == 0, zero


COLLECTIVE_JOB = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
import torch.distributed._functional_collectives as funcol
from megacache_client.torch import megacache_io, ranks
def gathered(x): return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
def local(x): return x.relu() * 3
torch.compile(gathered)(torch.ones(4)); torch.compile(local)(torch.ones(4))
arts = megacache_io.read_artifacts(torch.compiler.save_cache_artifacts()[0])
print(json.dumps({"all": {k: len(v) for k, v in arts.items()},
                  "bound": sorted(k for k, _ in ranks.bound(arts, "0/2"))}))
"""


def test_only_graphs_that_call_a_collective_are_bound_to_their_rank(tmp_path: Path) -> None:
    """Inductor's output of a graph with a functional collective is bound (its lowering may
    hold rank-specific code); a graph without one is shared, although every Inductor output
    names torch's c10d module in its preamble."""
    need("torch", "real torch.compile")
    env = clean_env() | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                         "OMP_NUM_THREADS": "1", "MEGACACHE_URL": ""}
    out = subprocess.run([sys.executable, "-c", COLLECTIVE_JOB % free_port()], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["all"] == {"inductor": 2, "aot_autograd": 2}, seen
    assert seen["bound"] == ["aot_autograd", "inductor"], seen  # one of each: the collective's


def test_bindings_round_trip_and_withhold_only_other_positions() -> None:
    from types import SimpleNamespace

    from megacache_client.torch import ranks

    def art(key: str) -> SimpleNamespace:
        return SimpleNamespace(key=key, content=b"")

    mine, theirs, shared = ("inductor", "f" + "a" * 51), ("inductor", "f" + "b" * 51), \
        ("inductor", "f" + "c" * 51)
    meta_value, left = ranks.render(ranks.merged(ours={mine}, where="0/2")
                                    | ranks.merged(ours={theirs}, where="1/2"))
    assert not left
    artifacts = {"inductor": [art(k) for _, k in (mine, theirs, shared)]}
    meta = {ranks.META: meta_value}
    assert ranks.withheld(artifacts, meta, "0/2") == {theirs}
    assert ranks.withheld(artifacts, meta, "1/2") == {mine}
    assert ranks.withheld(artifacts, meta, "0/1") == {mine, theirs}  # another world size
    both = {ranks.META: ranks.render(ranks.merged(ours={mine}, where="0/2")
                                     | ranks.merged(ours={mine}, where="1/2"))[0]}
    assert ranks.withheld(artifacts, both, "0/2") == {mine}  # whose it is, nobody can say
    assert ranks.restricted(meta, {theirs}) == {ranks.META: f"1/2={ranks.short(theirs)}"}
    many = {f"{n}/300": {f"inductor:{n:024d}"} for n in range(300)}
    rendered, left = ranks.render(many)
    assert len(rendered) <= ranks.MAX_META and left  # what does not fit is said, not cut
    assert sum(len(v) for v in ranks.parse({ranks.META: rendered}).values()) + len(left) == 300
