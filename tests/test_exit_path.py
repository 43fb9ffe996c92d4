"""The exit's publish round costs nothing when it has nothing to send (issue 48: a new
machine's exit should not pay ~0.5 s more than eager's): torch recorded no artifact since
a round that left the entry lacking nothing, so the exit skips the snapshot (serialising
every artifact, scanning the kernels). A compile after that round still ships at exit."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess

from benchmarks.harness.machines import Machine, run_job

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent


def inductor_artifacts(url: str, model: str) -> int:
    r = httpx.get(f"{url}/v1/ac", params={"model": model}, timeout=5)
    found = r.json()["entries"]
    return int(found[0]["artifact_counts"].get("inductor", 0)) if found else 0


def test_the_exit_skips_its_round_when_nothing_is_new(tmp_path: Path, toolchain: Path) -> None:
    need("torch", "the job compiles a real model")
    server = ServerProcess(tmp_path / "data").start()
    try:
        model = f"exit-{tmp_path.name[-8:]}".replace("_", "-")
        env = {"MEGACACHE_URL": server.url, "MEGACACHE_MODEL": model,
               "OMP_NUM_THREADS": "1", "MEGACACHE_PRECOMPILE": "0"}

        def job(machine: str, **extra: str) -> dict[str, int]:
            node = Machine(tmp_path / machine, toolchain if machine == "cold" else None)
            run = run_job(node, runner=[sys.executable, str(HERE / "exit_job.py")],
                          env={**env, **extra}, timeout=600)
            assert run.returncode == 0, run.stderr[-3000:]
            return run.result

        # the cold run compiles a second shape after its settled round: the exit ships it
        cold = job("cold", NEW_SHAPE="1")
        assert cold["early"] >= 1 and cold["exit"] == 1, cold
        shipped = inductor_artifacts(server.url, model)
        assert shipped >= 2  # both shapes' graphs: the second came with the exit's round
        # a new machine loads it all; its settled round finds nothing lacking; its exit
        # has nothing new and skips the snapshot
        warm = job("warm")
        assert warm["early"] >= 1 and warm["exit"] == 0, warm
        assert inductor_artifacts(server.url, model) == shipped
    finally:
        server.stop()
