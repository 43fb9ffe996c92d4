"""Precompiled Dynamo in the bundle, prefetch at enable, time to start in events.

Real training processes (benchmarks/train_job.py), real torch.compile of a small MLP, a
real server. One cold producer publishes with precompiled Dynamo on (the default);
each consumer is a fresh machine unless it only has to show the trainer survives.
Consumers that could change the entry run read-only so the tests do not depend on order.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ForwardingProxy, ServerProcess

from benchmarks.harness.machines import GxxCounter, JobRun, Machine, run_job
from megacache_client.wire.events import Event
from megacache_client.wire.schema import SchemaError, parse, parse_json

MODEL, CODE = "start-mlp", "v1"
READ_ONLY = {"MEGACACHE_MODE": "read-only"}
LATE_TOOLCHAIN_S = 12.0
SPLIT = ("tts_import_s", "tts_fetch_s", "tts_load_s", "tts_compile_s", "tts_rest_s")

pytestmark = pytest.mark.e2e


# -- the event's time-to-start fields: bounded (the server validates with this model) -------

def event(**fields: object) -> Event:
    return parse(Event, {"key": "a" * 64, "model": "m", "outcome": "hit", **fields})


def test_time_to_start_fields_are_optional_and_bounded() -> None:
    assert event().tts_s is None
    assert event(tts_s=12.5, tts_import_s=3.0).tts_s == 12.5
    for bad in (-0.001, 8 * 24 * 3600.0, math.inf, math.nan):
        with pytest.raises(SchemaError):
            event(tts_compile_s=bad)
    with pytest.raises(SchemaError):  # the server parses JSON: NaN spelled out is refused
        parse_json(Event, '{"key": "%s", "model": "m", "outcome": "hit", '
                     '"tts_s": NaN}' % ("a" * 64))


# -- real processes ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gxx(tmp_path_factory: pytest.TempPathFactory) -> GxxCounter:
    return GxxCounter(tmp_path_factory.mktemp("bin"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    need("torch", "the compile tests run real torch.compile")
    proc = ServerProcess(tmp_path_factory.mktemp("start-cache") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def run_on(machine: Machine, gxx: GxxCounter, url: str, *extra: str, code: str = CODE,
           env: dict[str, str] | None = None) -> JobRun:
    job = run_job(machine, "--model", "mlp", "--steps", "3", "--megacache", "explicit",
                  "--name", MODEL, "--code", code, *extra,
                  env={"MEGACACHE_URL": url, "MEGACACHE_PRECOMPILE": "1", **(env or {})},
                  gxx=gxx, timeout=900)
    if job.returncode != 0:
        raise AssertionError(f"job failed ({job.returncode}):\n{job.stderr[-4000:]}")
    return job


@pytest.fixture(scope="module")
def producer(cache: ServerProcess, gxx: GxxCounter, tmp_path_factory: pytest.TempPathFactory,
             toolchain: Path) -> tuple[Machine, JobRun]:
    """Machine A compiles cold with precompile on and publishes: the cold reference run (on
    a node whose toolchain is built: what it ships a new machine is what is examined)."""
    machine = Machine(tmp_path_factory.mktemp("start-a"), toolchain)
    run = run_on(machine, gxx, cache.url)
    assert run.mc["outcome"] == "miss" and run.mc["published"], run.mc
    entry = httpx.get(f"{cache.url}/v1/ac/{run.mc['key']}").json()
    assert entry["artifact_counts"].get("precompile", 0) >= 1, entry["artifact_counts"]
    bundle = next(b for b in entry["blobs"] if b["role"] == "megacache")
    assert bundle["meta"]["precompile_torch"], bundle["meta"]
    assert run.mc["isa_probe"] is None  # no kernels pack placed: torch probed on its own
    return machine, run


def counted(url: str, series: str) -> float:
    """The sum of a Prometheus counter's series that start with `series`, on the server."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(series))


def sent_bytes(url: str) -> float:
    """Response body bytes the server has sent so far."""
    return counted(url, "megacache_http_sent_bytes_total{")


def lookups(url: str) -> float:
    """Entry lookups by key the server has answered with an entry."""
    return counted(url, 'megacache_lookups_total{result="hit"}')


def stored_events(cache: ServerProcess) -> list[dict[str, object]]:
    with sqlite3.connect(cache.data_dir / "index.sqlite3") as db:
        return [json.loads(row[0]) for row in db.execute("SELECT event FROM events")]


def test_precompiled_start_is_bit_identical_prefetched_once_and_timed(
        cache, producer, gxx, tmp_path):
    _, cold = producer
    entry = httpx.get(f"{cache.url}/v1/ac/{cold.mc['key']}").json()
    total = sum(b["size"] for b in entry["blobs"])
    before, looked_up = sent_bytes(cache.url), lookups(cache.url)
    run = run_on(Machine(tmp_path / "b"), gxx, cache.url)
    sent = sent_bytes(cache.url) - before

    assert run.mc["outcome"] == "hit", run.mc
    assert run.result["precompile_hit"] == 1, run.mc  # Dynamo's output came from the bundle
    assert run.mc["precompile"] == ""
    assert run.result["losses"] == cold.result["losses"]  # bit-identical, every step
    assert run.gxx_builds == 0
    # torch's ISA probe ran off the trainer's thread, on the libraries the kernels pack placed
    assert run.mc["isa_probe"] == "megacache-isa-probe", run.mc
    # Nothing left in torch's local Dynamo cache for an ungated process to pick up.
    assert list((tmp_path / "b" / "inductor" / "dynamo").glob("*/entry")) == []
    # The prefetch (started at enable) fetched every blob; the first compile fetched none.
    prefetch = run.mc["prefetch"]
    assert prefetch["bytes_down"] + prefetch["toolchain_bytes"] == total, prefetch
    assert (prefetch["error"], prefetch["entry_key"]) == ("", entry["key"])
    assert run.mc["bytes_down"] == total  # the event counts the background toolchain too
    assert run.mc["bytes_down"] == total
    assert total <= sent < total + 1_000_000  # each blob crossed the wire once
    # The prefetch read the entry by key, and the zero-code hook's prefetch (before the
    # model was known) the entry it took the toolchain pack from (a listing only
    # nominates: the pack comes from an entry read through the gate); the first compile's
    # load asked nothing again.
    assert lookups(cache.url) - looked_up == 2

    stored = [e for e in stored_events(cache)
              if e["key"] == cold.mc["key"] and e["outcome"] == "hit"]
    ev = stored[-1]  # this run's: it reported before its process exited
    assert ev["precompile_hit"] == 1 and ev["precompile_reason"] == ""
    tts = ev["tts_s"]
    assert isinstance(tts, float) and 0 < tts <= run.wall_s
    parts = [ev[name] for name in SPLIT]
    assert all(isinstance(p, float) and 0 <= p <= tts for p in parts), ev
    assert sum(parts) == pytest.approx(tts, abs=0.02)
    assert ev["tts_import_s"] > 0  # `import torch` is never free
    # The trainer's own clock starts later (after interpreter start-up) and stops a little
    # later (after the optimizer step, within its first step's time).
    assert tts >= run.result["time_to_first_step_s"] - run.result["first_step_s"]


def test_an_exact_hit_waits_for_a_late_toolchain_instead_of_building_it(
        cache, producer, gxx, tmp_path):
    """Inductor precompiles its header before it loads each C++ kernel, a cached one too:
    an exact hit whose toolchain pack comes late must wait for it (bounded), not let torch
    spend seconds of g++ on a header the pack carries."""
    _, cold = producer
    entry = httpx.get(f"{cache.url}/v1/ac/{cold.mc['key']}").json()
    toolchain = next(b for b in entry["blobs"] if b["role"] == "toolchain")
    # the pack held back, as from a remote server on a slow link, until well after the job
    # reaches torch's header: the prefetch asks for it at `import torch`, the header comes
    # ~1.6 s later on an idle 2-core machine, over 5 s with the suite's other worker
    # compiling on a slow one (a 5 s hold came before it there); the load's deadline,
    # which bounds the prefetch, raised to outlast the hold
    late = ForwardingProxy(cache.url, hold=lambda method, path: LATE_TOOLCHAIN_S if (
        method == "GET" and path.endswith(toolchain["digest"])) else 0.0)
    with late:
        run = run_on(Machine(tmp_path / "late"), gxx, late.url,
                     env={**READ_ONLY, "MEGACACHE_LOAD_DEADLINE_S": str(3 * LATE_TOOLCHAIN_S)})
    assert run.mc["outcome"] == "hit", run.mc
    # The entry's own blobs did not queue behind the headers (the zero-code hook's
    # prefetch found the pack first; the explicit enable's prefetch took it over) ...
    assert run.mc["load_steps"]["prefetch"] < 2.5, run.mc
    assert run.mc["load_steps"]["toolchain"] > 0.5, run.mc  # ... the headers came late ...
    assert run.gxx_builds == 0, run.stderr[-2000:]  # ... and g++ never ran for it
    assert run.mc["placed"]["toolchain"] > 0
    assert run.result["losses"] == cold.result["losses"]


def test_failed_guard_recompiles_and_never_runs_a_wrong_graph(cache, producer, gxx, tmp_path):
    # Batch sizes 8, 12, 16 instead of the producer's 32: the precompiled entry's shape
    # guards fail, so Dynamo must trace and compile anew, not run the batch-32 graph.
    run = run_on(Machine(tmp_path / "c"), gxx, cache.url, "--shapes", "varying",
                 "--eager-check", env=READ_ONLY)
    # The lookup hit; the event says "inert" because none of the bundle's graphs fit.
    assert run.mc["entry_key"] == run.mc["key"] and run.mc["outcome"] == "inert", run.mc
    assert run.result["precompile_hit"] == 1  # the precompiled entry was installed ...
    assert run.result["frames"] >= 1  # ... and Dynamo compiled the new shapes itself
    assert run.result["eager_gap"] < 1e-4, run.result  # same numbers as eager PyTorch
    assert "Traceback" not in run.stderr


def test_other_code_never_loads_precompiled_dynamo(cache, producer, gxx, tmp_path):
    _, cold = producer
    run = run_on(Machine(tmp_path / "d"), gxx, cache.url, code="v2", env=READ_ONLY)
    assert run.mc["outcome"] == "fallback", run.mc
    assert "fallback" in run.mc["precompile"], run.mc
    assert run.result["precompile_hit"] == 0
    # The rest of the bundle still helps: AOTAutograd's entries (their Inductor graphs
    # inside) hit, which they only do across processes with the client's stable keys.
    counters = run.result["counters"]
    assert counters["aot_hit"] > 0 and counters["aot_miss"] == 0, counters
    assert counters["fxgraph_miss"] == 0 and run.gxx_builds == 0, counters
    assert run.result["losses"] == cold.result["losses"]


def test_precompile_from_another_torch_is_refused_with_a_reason(cache, producer, gxx,
                                                                 tmp_path):
    _, cold = producer
    url = f"{cache.url}/v1/ac/{cold.mc['key']}"
    original = httpx.get(url)
    skewed = original.json()
    for blob in skewed["blobs"]:
        if blob["role"] == "megacache":
            blob["meta"]["precompile_torch"] = "2.12.0"
    put = httpx.put(url, content=json.dumps(skewed),
                    headers={"content-type": "application/json",
                             "if-match": original.headers["etag"]})
    assert put.status_code in (200, 201), put.text
    try:
        run = run_on(Machine(tmp_path / "e"), gxx, cache.url, env=READ_ONLY)
    finally:
        current = httpx.get(url).headers["etag"]
        httpx.put(url, content=original.content,
                  headers={"content-type": "application/json", "if-match": current})
    assert run.mc["outcome"] == "hit", run.mc
    assert "torch 2.12.0" in run.mc["precompile"], run.mc
    assert run.result["precompile_hit"] == 0
    assert run.result["losses"] == cold.result["losses"]
    assert run.gxx_builds == 0  # only Dynamo's part is redone


def test_stuck_prefetch_never_blocks_the_first_compile(producer, gxx, hanging_server):
    machine, _ = producer  # local caches warm: this run only has to show the trainer goes on
    run = run_on(machine, gxx, hanging_server,
                 env={"MEGACACHE_PREFETCH_WAIT_S": "0.5", "MEGACACHE_READ_TIMEOUT_S": "5",
                      "MEGACACHE_RETRIES": "0", **READ_ONLY})
    assert run.mc["outcome"] == "error", run.mc
    assert run.mc["load_steps"]["prefetch"] < 4.0  # waited ~0.5 s, not the 5 s read timeout
    assert run.result["losses"][0] > 0
    assert len(run.warnings()) == 1, run.stderr
    assert "prefetch still running" in run.warnings()[0]


def test_precompile_is_on_by_default_and_zero_turns_it_off(tmp_path: Path) -> None:
    torch = need("torch")
    from megacache_client.config import ClientConfig
    from megacache_client.torch import precompile

    before = torch._dynamo.config.caching_precompile
    try:
        torch._dynamo.config.caching_precompile = False
        off = ClientConfig.from_env({"MEGACACHE_URL": "http://127.0.0.1:1",
                                     "MEGACACHE_PRECOMPILE": "0"})
        said = precompile.turn_on(off)
        assert torch._dynamo.config.caching_precompile is False  # 0: off entirely ...
        assert said == "precompiled Dynamo off (MEGACACHE_PRECOMPILE=0)"  # ... and says so
        default = ClientConfig.from_env({"MEGACACHE_URL": "http://127.0.0.1:1"})  # zero-code
        assert default.precompile is True
        assert ClientConfig(url="http://127.0.0.1:1").precompile is True
        assert precompile.turn_on(default) == ""
        assert torch._dynamo.config.caching_precompile is True
    finally:
        torch._dynamo.config.caching_precompile = before


def test_only_precompile_artifacts_the_producer_verified_are_loaded() -> None:
    """An entry names the precompile artifacts its producer's child-process check passed;
    a consumer loads no other (an older entry names none: all traced here instead)."""
    torch = need("torch")
    import platform
    from types import SimpleNamespace

    from megacache_client.torch import precompile
    from megacache_client.wire.manifest import BlobRef

    good = {precompile.META_TORCH: torch.__version__,
            precompile.META_PYTHON: platform.python_version(), precompile.META_IDS: "7"}
    artifacts = {"precompile": [SimpleNamespace(key="a" * 64, content=b""),
                                SimpleNamespace(key="b" * 64, content=b"")],
                 "inductor": [SimpleNamespace(key="fx", content=b"")]}
    with torch._dynamo.config.patch(caching_precompile=True):
        old = BlobRef(digest="b" * 64, size=1, role="megacache", meta=good)
        kept, note = precompile.for_loading(artifacts, "hit", old)
        assert kept["precompile"] == [] and len(kept["inductor"]) == 1
        assert "2 precompiled Dynamo entries not loaded: not verified" in note
        one = BlobRef(digest="b" * 64, size=1, role="megacache",
                      meta={**good, precompile.META_VERIFIED: "a" * 64})
        kept, note = precompile.for_loading(artifacts, "hit", one)
        # b is refused unverified; a (verified) goes on to the restorability check, which
        # refuses these empty bytes as unreadable
        assert note.startswith("1 precompiled Dynamo entry not loaded: not verified"), note
        assert "unreadable" in note and kept["precompile"] == []


def test_precompile_is_loaded_only_from_an_exact_hit_of_the_same_torch() -> None:
    torch = need("torch")
    import platform

    from megacache_client.torch import precompile
    from megacache_client.wire.manifest import BlobRef

    def bundle(**meta: str) -> BlobRef:
        good = {precompile.META_TORCH: torch.__version__,
                precompile.META_PYTHON: platform.python_version(), precompile.META_IDS: "7"}
        return BlobRef(digest="b" * 64, size=1, role="megacache", meta={**good, **meta})

    with torch._dynamo.config.patch(caching_precompile=True):
        assert precompile.refusal("hit", bundle()) == ""
        assert "fallback" in precompile.refusal("fallback", bundle())
        assert "torch 2.12.0" in precompile.refusal("hit", bundle(precompile_torch="2.12.0"))
        assert "Python 3.99.0" in precompile.refusal("hit", bundle(precompile_python="3.99.0"))
        assert "unique-id" in precompile.refusal("hit", bundle(precompile_unique_ids="x"))
    with torch._dynamo.config.patch(caching_precompile=False):
        assert "off" in precompile.refusal("hit", bundle())


def test_process_start_is_read_from_the_boot_clock() -> None:
    """The event's clock starts when the kernel started the process: after the parent asked
    for it and before the child's first line ran. The boot time in /proc/stat cannot give
    that: its 1 s resolution and the wall clock's drift put a start outside the window."""
    asked = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "import time; first_line = time.time()\n"
         "from megacache_client.torch import start_clock\n"
         "print(start_clock.process_start_time(), first_line)"],
        capture_output=True, text=True, check=True).stdout.split()
    started, first_line = float(out[0]), float(out[1])
    tick = 1 / os.sysconf("SC_CLK_TCK")  # the kernel records the start in clock ticks
    assert asked - tick <= started <= first_line
