"""Precompiled Dynamo made safe to ship: what a new machine cannot restore is never shipped
nor loaded, and a republish keeps everything the run loaded.

Real torch.compile in fresh processes (precompile's patches are process-wide), a real
server for the republish sequence.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need
from helpers import ServerProcess, functions_job

from benchmarks.harness.machines import GxxCounter, JobRun, Machine, run_job

pytestmark = pytest.mark.e2e

need("torch", "precompile tests run real torch.compile")

HERE = Path(__file__).resolve().parent

# A function whose Dynamo output loads `collections` through a global Dynamo names by the
# module's object id (rebuilding an OrderedDict): its module imports only the class, as
# Hugging Face's modeling files do.
PRODUCER = textwrap.dedent("""
    import json, os, sys
    from collections import OrderedDict
    import torch
    from megacache_client.torch import precompile
    from megacache_client.torch import megacache_io

    torch._dynamo.config.caching_precompile = True
    precompile.record_installed_globals()
    if sys.argv[1] == "record-aliases":
        precompile.record_module_aliases()

    def f(x):
        d = OrderedDict()
        d["a"] = x.sin()
        return d

    torch.compile(f)(torch.ones(3))
    raw, _ = megacache_io.save_bundle()
    artifacts = megacache_io.read_artifacts(raw)
    kept, note = precompile.for_shipping(artifacts, {})
    open(sys.argv[2], "wb").write(raw)
    print(json.dumps({"unrestorable": precompile.unrestorable(artifacts), "note": note,
                      "shipped": len(kept.get("precompile", []))}))
""")

CONSUMER = textwrap.dedent("""
    import json, sys
    from collections import OrderedDict
    import torch
    from megacache_client.torch import precompile
    from megacache_client.torch import megacache_io
    from megacache_client.wire.manifest import BlobRef

    torch._dynamo.config.caching_precompile = True
    artifacts = megacache_io.read_artifacts(open(sys.argv[1], "rb").read())
    # the producer's own meta checks pass: this test is about what the bytecode needs
    ref = BlobRef(digest="0" * 64, size=1, role="megacache", meta={
        precompile.META_TORCH: torch.__version__, precompile.META_PYTHON:
        __import__("platform").python_version(), precompile.META_IDS: "0",
        precompile.META_VERIFIED: ",".join(a.key for a in artifacts.get("precompile", []))})
    kept, note = precompile.for_loading(artifacts, "hit", ref)
    print(json.dumps({"kept": len(kept.get("precompile", [])), "note": note}))
""")


def python(tmp_path: Path, script: str, *args: str) -> dict:
    path = tmp_path / f"script-{len(list(tmp_path.iterdir()))}.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ,
                                            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_entry_whose_bytecode_needs_an_unrecorded_global_is_neither_shipped_nor_loaded(
        tmp_path):
    bundle = tmp_path / "bundle.bin"
    unpatched = python(tmp_path, PRODUCER, "as-torch-records", str(bundle))
    (missing,) = unpatched["unrestorable"].values()
    assert missing[0].startswith("___module_collections_"), missing
    assert unpatched["shipped"] == 0 and "would not be defined" in unpatched["note"]
    # a consumer given such an entry anyway (an older producer) leaves it out
    consumer = python(tmp_path, CONSUMER, str(bundle))
    assert consumer["kept"] == 0 and missing[0] in consumer["note"], consumer


def test_a_script_aliased_as_mp_main_is_still_its_own_home():
    """A script is both `__main__` and, once multiprocessing ran, `__mp_main__` (same
    file): the names torch restores into `__main__` count for its code."""
    import types

    from megacache_client.torch.precompile import _defining_module

    script = types.ModuleType("__main__")
    script.__file__ = "/job/train.py"
    library = types.ModuleType("lib.modeling")
    library.__file__ = "/site/lib/modeling.py"
    modules = {"__main__": script, "__mp_main__": script, "lib.modeling": library}
    by_file = {m.__file__: name for name, m in modules.items()}  # __mp_main__ wins here
    code = types.SimpleNamespace(python_module="__main__",
                                 python_code=types.SimpleNamespace(co_filename="/job/train.py"))
    assert _defining_module(code, modules, by_file) == "__main__"
    # a wrapper that copied the library function's __module__ (functools.wraps)
    wrapped = types.SimpleNamespace(python_module="__main__", python_code=types.SimpleNamespace(
        co_filename="/site/lib/modeling.py"))
    assert _defining_module(wrapped, modules, by_file) == "lib.modeling"


def test_recording_module_aliases_makes_the_entry_restorable(tmp_path):
    bundle = tmp_path / "bundle.bin"
    patched = python(tmp_path, PRODUCER, "record-aliases", str(bundle))
    assert patched["unrestorable"] == {} and patched["shipped"] == 1, patched
    consumer = python(tmp_path, CONSUMER, str(bundle))
    assert consumer == {"kept": 1, "note": ""}


# -- republish keeps what it loaded ------------------------------------------------------

@pytest.fixture(scope="module")
def gxx(tmp_path_factory: pytest.TempPathFactory) -> GxxCounter:
    return GxxCounter(tmp_path_factory.mktemp("bin"))


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path / "data").start()
    yield proc
    proc.stop()


@pytest.mark.parametrize("precompile", ["1", "0"])
def test_a_republish_keeps_what_it_loaded(cache, gxx, tmp_path, precompile, toolchain):
    """Machine 1 compiles f; machine 2 loads f, compiles g and republishes; machine 3 only
    runs f: everything comes from the entry, nothing is compiled, nothing is inert."""
    first = functions_job(Machine(tmp_path / "m1", toolchain), gxx, cache.url, "f", precompile)
    assert first.result["published"], first.result
    second = functions_job(Machine(tmp_path / "m2"), gxx, cache.url, "f,g", precompile)
    assert second.result["outcome"] == "hit", second.result  # f came from the entry
    assert second.result["published"], second.result  # g was new
    assert second.warnings() == [], second.stderr
    third = functions_job(Machine(tmp_path / "m3"), gxx, cache.url, "f", precompile)
    assert third.result["results"]["f"] == first.result["results"]["f"]
    assert third.result["outcome"] == "hit", third.result
    assert third.gxx_builds == 0 and third.warnings() == [], third.stderr
    assert third.result["counters"]["fxgraph_miss"] == 0, third.result
    if precompile == "1":  # f ran from its precompiled entry, shipped again by machine 2
        assert third.result["precompile"]["served"] > 0, third.result
        assert third.result["artifact_counts"]["precompile"] == 2, third.result
    else:
        assert third.result["counters"]["fxgraph_hit"] > 0, third.result
    assert not third.result["published"], third.result  # it had everything


# -- verified by the publisher's child-process check -------------------------------------

def precompile_job(machine: Machine, gxx: GxxCounter, url: str, kind: str,
                   end: str = "exit") -> JobRun:
    """`tests/precompile_job.py` on `machine`, precompiled Dynamo at its default (on);
    `end="killed"`: SIGKILLed once the check's background round ended (no exit round)."""
    run = run_job(machine, kind, end, runner=[sys.executable, str(HERE / "precompile_job.py")],
                  env={"MEGACACHE_URL": url}, gxx=gxx, timeout=600)
    expected = -signal.SIGKILL if end == "killed" else 0
    assert run.returncode == expected, run.stderr[-4000:]
    return run


def test_a_verified_entry_lets_a_new_machine_skip_tracing(cache, gxx, tmp_path, toolchain):
    """The producer's child check passes: the entry names the artifact verified, and a new
    machine's first step runs it without Dynamo tracing anything. The producer ships it in
    the background: its settled point's round ships the rest of the compile with the
    artifact pending, and the round the verdicts start adds it. The producer is then
    SIGKILLed, so no exit round (which waits for the check) can have shipped it."""
    cold = precompile_job(Machine(tmp_path / "m1", toolchain), gxx, cache.url, "plain",
                          "killed")
    assert cold.result["published"] and cold.result["traced_graphs"] >= 1, cold.result
    assert cold.result["check_s"] > 0, cold.result  # the child really ran
    new = precompile_job(Machine(tmp_path / "m2"), gxx, cache.url, "plain")
    meta = new.result["loaded_meta"]
    assert new.result["loaded_counts"].get("precompile", 0) == 1, new.result
    assert len(meta["precompile_verified"].split(",")) == 1, meta
    assert new.result["traced_graphs"] == 0, new.result  # Dynamo traced nothing
    assert new.result["precompile"]["served"] > 0 and new.result["precompile_reason"] == ""
    assert new.result["losses"] == cold.result["losses"]
    assert new.gxx_builds == 0 and new.warnings() == [], new.stderr


def test_an_entry_that_fails_the_check_is_not_shipped_and_new_machines_trace(
        cache, gxx, tmp_path, toolchain):
    """A real miscompiling Inductor pass (relu made sigmoid after tracing): the child's
    call of the precompiled graph differs from the traced graph's, so the artifact is not
    verified nor shipped; the rest of the bundle is, and a new machine traces Dynamo and
    trains on, unharmed."""
    cold = precompile_job(Machine(tmp_path / "m1", toolchain), gxx, cache.url, "flip")
    assert cold.result["published"], cold.result
    assert "not verified" in cold.result["precompile_reason"], cold.result
    assert "differs from the traced graph" in cold.result["precompile_reason"], cold.result
    assert "not verified, not shipped" in cold.stderr  # logged once
    assert cold.stderr.count("not verified, not shipped") == 1, cold.stderr
    new = precompile_job(Machine(tmp_path / "m2"), gxx, cache.url, "flip")
    assert new.result["outcome"] == "hit", new.result
    assert new.result["loaded_counts"].get("precompile", 0) == 0, new.result
    assert "precompile_verified" not in new.result["loaded_meta"], new.result
    assert new.result["traced_graphs"] >= 1, new.result  # traced as without precompile
    c = new.result["counters"]
    assert c["fxgraph_hit"] + c["aot_hit"] > 0, new.result  # the rest still helped
    assert not new.result["published"], new.result  # what failed is not lacking: no thrash
    assert new.result["losses"] == cold.result["losses"]
    assert new.gxx_builds == 0, new.stderr
