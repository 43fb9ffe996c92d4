"""Third-party models on new machines, zero-code, with precompiled Dynamo on and off.

A default is a promise to every trainer, so the models here are ones nobody on this
project wrote (`transformers` architectures built from tiny configs, tests/corpus_job.py),
run the way a user runs them: an unmodified script, `torch.compile(model)`, and only
`MEGACACHE_*` variables set (the autoload hook does the rest). For each model one cold
machine compiles with precompiled Dynamo on and publishes; then two new machines start
from that entry side by side, one with precompiled Dynamo on (the exact entry, Dynamo's
output included) and one with it off (the default: the same model's entry, Inductor and
AOTAutograd artifacts and kernels only). A crash, a loss that is not bit-identical to the
cold run's, a g++ build or a megacache warning on a new machine fails the test.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess
from jobs import GxxCounter, JobRun, Machine, run_job

HERE = Path(__file__).resolve().parent
JOB = HERE / "corpus_job.py"
sys.path.insert(0, str(HERE))
from corpus_job import CORPUS  # noqa: E402

pytestmark = pytest.mark.e2e

need("torch", "the corpus runs real torch.compile")
need("transformers", "the corpus is transformers models")

STEPS = "3"


@pytest.fixture(scope="module")
def gxx(tmp_path_factory: pytest.TempPathFactory) -> GxxCounter:
    return GxxCounter(tmp_path_factory.mktemp("bin"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("corpus-cache") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def train(machine: Machine, gxx: GxxCounter, url: str, name: str, precompile: str) -> JobRun:
    """The unmodified script on `machine`; megacache only through the environment."""
    env = {"MEGACACHE_URL": url, "MEGACACHE_MODEL": f"corpus-{name}",
           "MEGACACHE_PRECOMPILE": precompile, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    return run_job(machine, str(JOB), name, STEPS, env=env, gxx=gxx,
                   runner=[sys.executable], timeout=900)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_new_machines_match_the_cold_run(cache, gxx, tmp_path, name):
    cold = train(Machine(tmp_path / "cold"), gxx, cache.url, name, "1")
    assert cold.returncode == 0, cold.stderr[-4000:]
    assert cold.gxx_builds and cold.gxx_builds > 0  # it really compiled

    with ThreadPoolExecutor(2) as pool:
        on, off = pool.map(lambda pc: train(Machine(tmp_path / f"new-{pc}"), gxx, cache.url,
                                            name, pc), ("1", "0"))
    for precompile, run in (("on", on), ("off", off)):
        where = f"{name}, precompiled Dynamo {precompile}"
        assert run.returncode == 0, f"{where} crashed:\n{run.stderr[-4000:]}"
        assert run.result["losses"] == cold.result["losses"], where
        assert run.gxx_builds == 0, f"{where}: {run.gxx_builds} g++ builds"
        assert run.warnings() == [], f"{where}: {run.warnings()}"
    # Precompiled Dynamo ran wherever the producer shipped any: the producer leaves out
    # what a new machine could not restore, and what it ships must then load.
    assert off.result["precompile_hit"] == 0
    shipped = max(e["artifact_counts"].get("precompile", 0) for e in entries(cache, name))
    assert (on.result["precompile_hit"] >= 1) == (shipped >= 1), (shipped, on.result)


def entries(cache: ServerProcess, name: str) -> list[dict]:
    listing = httpx.get(cache.url + "/v1/ac", params={"model": f"corpus-{name}"})
    listing.raise_for_status()
    return list(listing.json()["entries"])
