"""Third-party models on new machines, zero-code, with precompiled Dynamo on and off.

A default is a promise to every trainer, so the models here are ones nobody on this
project wrote (`transformers` architectures from tiny configs, benchmarks/harness/corpus_job.py),
run the way a user runs them: an unmodified script, `torch.compile(model)`, and only
`MEGACACHE_*` variables set (the autoload hook does the rest; gpt2's with no
`MEGACACHE_MODEL`: the client names its entry after the model's class). For each model one cold
machine compiles with precompiled Dynamo on and publishes; then two new machines start
from that entry side by side, one with precompiled Dynamo on (the exact entry, Dynamo's
output included) and one with it off (the default: the same model's entry, Inductor and
AOTAutograd artifacts and kernels only). A crash, a loss that is not bit-identical to the
cold run's, a g++ build or a megacache warning on a new machine fails the test.
CI runs gpt2 and resnet (`IN_CI`) with both machines; the nightly tier (`pytest -m nightly`)
runs the other four (bert, llama, t5, vit) with both.
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

from benchmarks.harness import CORPUS_JOB
from benchmarks.harness.corpus_job import CORPUS
from benchmarks.harness.machines import GxxCounter, JobRun, Machine, run_job

HERE = Path(__file__).resolve().parent
JOB = CORPUS_JOB

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("torch_s_own_compile_threads")]

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


NAMED_BY_THE_CLIENT = {"gpt2": "GPT2LMHeadModel"}
"""Models run without MEGACACHE_MODEL: the client names the entry after the compiled
module's class (the zero-code default a user gets with only MEGACACHE_URL set)."""


def model_name(name: str) -> str:
    """The entry's model name the corpus job `name` publishes under."""
    return NAMED_BY_THE_CLIENT.get(name, f"corpus-{name}")


def train(machine: Machine, gxx: GxxCounter, url: str, name: str, precompile: str) -> JobRun:
    """The unmodified script on `machine`; megacache only through the environment."""
    env = {"MEGACACHE_URL": url, "MEGACACHE_PRECOMPILE": precompile, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    if name not in NAMED_BY_THE_CLIENT:
        env["MEGACACHE_MODEL"] = model_name(name)
    return run_job(machine, str(JOB), name, STEPS, env=env, gxx=gxx,
                   runner=[sys.executable], timeout=900)


IN_CI = ("gpt2", "resnet")
"""The models of every CI run: a causal LM named by the client (the zero-code default)
whose precompiled Dynamo output the producer refuses, and convolutions with batch norm,
the one model whose output ships: between them every path of a new machine (an exact hit
with and without Dynamo's output, the fallback with precompiled Dynamo off). llama
(rotary embeddings, RMSNorm, grouped-query attention), t5 (an encoder-decoder), bert and
vit run in the nightly tier (`pytest -m nightly`), for CI's 25 minutes: each cost CI about
a minute of one worker."""
# --dist loadfile pins a file to one worker: the CI models are split over two files
# (this one and tests/test_corpus_b.py) so that two workers share the corpus.
GROUP_A = ("resnet",)
GROUP_B = ("gpt2",)
SHIPS_PRECOMPILE = ("resnet",)
"""The models whose precompiled Dynamo output passes the producer's check on torch 2.13
(the other five are refused for reasons docs/benchmarks.md gives: wraps-copied modules,
guards that need a running frame, every frame left out); a change either way fails."""


def check_new_machines(cache: ServerProcess, gxx: GxxCounter, tmp_path: Path,
                       name: str, toolchain: Path) -> None:
    """One cold machine with precompiled Dynamo on (its toolchain built: what it ships the
    new machines is what is examined), then a new machine per mode in `MODES`."""
    cold = train(Machine(tmp_path / "cold", toolchain), gxx, cache.url, name, "1")
    assert cold.returncode == 0, cold.stderr[-4000:]
    assert cold.gxx_builds and cold.gxx_builds > 0  # it really compiled
    assert outcomes(cache, name) == {"miss": 1}

    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(MODES, pool.map(
            lambda pc: train(Machine(tmp_path / f"new-{pc}"), gxx, cache.url, name, pc),
            MODES), strict=True))
    for precompile, run in runs.items():
        where = f"{name}, precompiled Dynamo {'on' if precompile == '1' else 'off'}"
        assert run.returncode == 0, f"{where} crashed:\n{run.stderr[-4000:]}"
        assert run.result["losses"] == cold.result["losses"], where
        assert run.gxx_builds == 0, f"{where}: {run.gxx_builds} g++ builds"
        if precompile == "1":  # the producer's setting: torch compiled nothing again
            assert run.result["fxgraph_miss"] == run.result["aot_miss"] == 0, (where,
                                                                               run.result)
        assert run.warnings() == [], f"{where}: {run.warnings()}"
    # the server counted each start: precompiled Dynamo on is the producer's key (a hit),
    # off is another key of the same model (a fallback to the producer's entry)
    assert outcomes(cache, name) == {"miss": 1, "hit": 1, "fallback": 1}
    assert runs["0"].result["precompile_hit"] == 0
    # Precompiled Dynamo ran wherever the producer shipped any: the producer leaves out
    # what a new machine could not restore, and what it ships must then load.
    shipped = max(e["artifact_counts"].get("precompile", 0) for e in entries(cache, name))
    assert (shipped >= 1) == (name in SHIPS_PRECOMPILE), (name, shipped)
    assert (runs["1"].result["precompile_hit"] >= 1) == (shipped >= 1), (
        shipped, runs["1"].result)


MODES = ("1", "0")
"""A new machine with precompiled Dynamo on (the producer's setting) and one with it off."""


@pytest.mark.parametrize("name", GROUP_A)
def test_new_machines_match_the_cold_run(cache, gxx, tmp_path, name, toolchain):
    check_new_machines(cache, gxx, tmp_path, name, toolchain)


def test_the_corpus_is_split_between_ci_and_the_nightly_tier():
    """Every model runs somewhere: the two CI halves are IN_CI, the rest is nightly."""
    assert sorted(GROUP_A + GROUP_B) == sorted(IN_CI) and set(IN_CI) <= set(CORPUS)


@pytest.mark.nightly
@pytest.mark.parametrize("name", [n for n in sorted(CORPUS) if n not in IN_CI])
def test_new_machines_match_the_cold_run_nightly(cache, gxx, tmp_path, name, toolchain):
    check_new_machines(cache, gxx, tmp_path, name, toolchain)


def outcomes(cache: ServerProcess, name: str) -> dict[str, int]:
    """The server's count of each lookup outcome of the model's jobs (zeros left out)."""
    models = {m["model"]: m for m in httpx.get(cache.url + "/v1/stats").json()["models"]}
    counts = models.get(model_name(name), {}).get("outcomes", {})
    return {k: v for k, v in counts.items() if v}


def entries(cache: ServerProcess, name: str) -> list[dict]:
    listing = httpx.get(cache.url + "/v1/ac", params={"model": model_name(name)})
    listing.raise_for_status()
    return list(listing.json()["entries"])
