"""Compiled kernels at any torch install path (megacache_client/torch/relocate.py).

Unit tests of identities, pack indexes, placement and the build check; then one end-to-end
run: a real producer publishes, a consumer whose torch is imported from another path
(a symlinked copy of this venv's torch on PYTHONPATH: the path Inductor puts in its flags
changes, nothing else) starts with zero g++ builds and does not re-publish, and a consumer
at the producer's path after it still builds nothing (no thrash).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess

from benchmarks.harness.machines import GxxCounter, JobRun, Machine, run_job
from megacache_client.config import ClientConfig
from megacache_client.steps.fetch import skip_reason
from megacache_client.torch import relocate
from megacache_client.torch.packs import (
    INDEX_NAME,
    PackError,
    pack_names,
    read_index,
    unpack,
    write_pack,
)
from megacache_client.wire.manifest import BlobRef

torch = need("torch", "kernel relocation compiles with torch")

CODE = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(float* p) {}\n'
PATHS_A = (("@TORCH@", "/venv-a/site-packages/torch"), ("@PY_INCLUDE@", "/usr/include/py"))
PATHS_B = (("@TORCH@", "/opt/conda/site-packages/torch"), ("@PY_INCLUDE@", "/opt/py/include"))


def flags(torch_dir: str, py_include: str, isa: str = "-mavx512f") -> str:
    return (f"None g++ i -O3 -march=native -I{py_include} -I{torch_dir}/include "
            f"{isa} -o o.so -L{torch_dir}/lib")


# -- identities ---------------------------------------------------------------------------

def test_identity_is_the_same_at_another_install_path():
    a = relocate.identity(CODE, "main.cpp", flags("/venv-a/site-packages/torch",
                                                  "/usr/include/py"), PATHS_A)
    b = relocate.identity(CODE, "main.cpp", flags("/opt/conda/site-packages/torch",
                                                  "/opt/py/include"), PATHS_B)
    assert a == b
    # leading/trailing blanks do not change torch's key either (it hashes content.strip())
    assert relocate.identity("\n" + CODE + "  ", "main.cpp", flags(
        "/venv-a/site-packages/torch", "/usr/include/py"), PATHS_A) == a


def test_identity_changes_with_flags_source_and_kind():
    base = relocate.identity(CODE, "main.cpp", flags("/t", "/p"), (("@TORCH@", "/t"),))
    other_isa = relocate.identity(CODE, "main.cpp", flags("/t", "/p", isa="-mavx2"),
                                  (("@TORCH@", "/t"),))
    other_code = relocate.identity(CODE + "//x", "main.cpp", flags("/t", "/p"),
                                   (("@TORCH@", "/t"),))
    other_kind = relocate.identity(CODE, "h", flags("/t", "/p"), (("@TORCH@", "/t"),))
    assert len({base, other_isa, other_code, other_kind}) == 4
    # an unknown directory is not a placeholder: a flag naming it keeps the kernels apart
    assert relocate.identity(CODE, "main.cpp", "-I/somewhere/else", PATHS_A) != \
        relocate.identity(CODE, "main.cpp", "-I/elsewhere/else", PATHS_A)


def test_header_identity_drops_the_preprocessed_hash_only():
    def header(pp: str, cmd: str = "g++ -I/t/include") -> str:
        return relocate.identity("#include <x.h>\n", "h", cmd + pp + "gcc 12.2",
                                 (("@TORCH@", "/t"),))

    assert header("a" * 128) == header("b" * 128)
    assert header("a" * 128) != header("a" * 128, cmd="g++ -DOTHER -I/t/include")


def test_real_install_paths_cover_torchs_own_flags():
    from torch.utils.cpp_extension import TORCH_LIB_PATH, include_paths

    here = " ".join(f"-I{p}" for p in include_paths()) + f" -L{TORCH_LIB_PATH}"
    canonical = relocate.canonical(here)
    assert os.path.dirname(torch.__file__) not in canonical
    assert "@TORCH@/include" in canonical and "@TORCH@/lib" in canonical


# -- the build check ------------------------------------------------------------------------

@pytest.mark.parametrize("fact", ["isa", "march", "cxx", "torch", "torch_git", "arch"])
def test_pack_from_another_build_is_refused_with_a_reason(fact):
    ours = relocate.build_facts()
    theirs = {**relocate.build_meta(), relocate.BUILD_META_PREFIX + fact: "something-else"}
    reason = relocate.refusal(theirs, ours)
    assert fact in reason and "something-else" in reason
    assert relocate.refusal(relocate.build_meta(), ours) == ""


def test_session_skips_a_foreign_kernel_pack_before_downloading_it(tmp_path):
    from megacache_client.lifecycle import Session

    session = Session(ClientConfig(url="http://127.0.0.1:9", node_cache_dir=tmp_path))
    meta = {**relocate.build_meta(), "build.isa": "avx2-from-another-host", "files": "3"}
    for role in ("kernels", "toolchain"):
        blob = BlobRef(digest="0" * 64, size=1, role=role, meta=meta)
        reason = skip_reason(session.config, blob)
        assert "isa" in reason and "avx2-from-another-host" in reason
    same = BlobRef(digest="0" * 64, size=1, role="kernels", meta=relocate.build_meta())
    assert skip_reason(session.config, same) == ""


def test_pack_of_an_older_client_is_used_only_at_its_torch_path():
    from megacache_client.torch.env import torch_prefix

    assert relocate.refusal({"torch_prefix": torch_prefix()}) == ""
    assert "/elsewhere/torch" in relocate.refusal({"torch_prefix": "/elsewhere/torch"})


# -- pack index and placement ---------------------------------------------------------------

def test_pack_index_travels_first_and_is_never_extracted(tmp_path):
    src = tmp_path / "k.main.so"
    src.write_bytes(b"\x7fELF kernel")
    pack = tmp_path / "p.tzst"
    index = relocate.index_bytes({"ab/k.main.so": "f" * 64})
    write_pack([("ab/k.main.so", src)], pack, index=index)
    assert read_index(pack) == index
    assert relocate.parse_index(read_index(pack)) == {"ab/k.main.so": "f" * 64}
    assert pack_names(pack, cap=1 << 20) == ["ab/k.main.so"]
    out = tmp_path / "out"
    assert unpack(pack, out, suffixes=(".so",), cap=1 << 20) == ["ab/k.main.so"]
    assert not (out / INDEX_NAME).exists()

    plain = tmp_path / "plain.tzst"
    write_pack([("ab/k.main.so", src)], plain)
    assert read_index(plain) is None
    with pytest.raises(PackError, match="reserved"):
        write_pack([(INDEX_NAME, src)], tmp_path / "bad.tzst")


def test_malformed_index_is_a_clear_error():
    with pytest.raises(PackError, match="index is malformed"):
        relocate.parse_index(b"{not json")
    with pytest.raises(PackError, match="index is malformed"):
        relocate.parse_index(json.dumps({"format": 99, "files": {}}).encode())


def test_recorder_places_a_shipped_kernel_under_torchs_local_name(tmp_path):
    rec = relocate.KeyRecorder()
    extra = flags("/t", "/p")
    ident = relocate.identity(CODE, "main.cpp", extra)
    shipped = tmp_path / "aa" / "cshipped.main.so"
    shipped.parent.mkdir()
    shipped.write_bytes(b"kernel bytes")
    rec.learn(tmp_path, {"aa/cshipped.main.so": ident})

    rec.seen(CODE, "main.cpp", extra, str(tmp_path / "bb" / "clocal.main.cpp"))
    assert (tmp_path / "bb" / "clocal.main.so").read_bytes() == b"kernel bytes"
    assert rec.placed == 1
    # the local name now stands for the same identity: publishing would send it once
    files = {"aa/cshipped.main.so": shipped, "bb/clocal.main.so": tmp_path / "bb" /
             "clocal.main.so"}
    ids = rec.ids_for(files)
    assert set(ids.values()) == {ident} and len(relocate.dedupe(files, ids)) == 1

    # unknown source: nothing placed; an existing file is never overwritten
    rec.seen(CODE + "//other", "main.cpp", extra, str(tmp_path / "cc" / "cnew.main.cpp"))
    assert not (tmp_path / "cc" / "cnew.main.so").exists()
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "cmine.main.so").write_bytes(b"built here")
    rec.seen(CODE, "main.cpp", extra, str(tmp_path / "dd" / "cmine.main.cpp"))
    assert (tmp_path / "dd" / "cmine.main.so").read_bytes() == b"built here"


def test_header_hold_lets_a_late_toolchain_pack_stand_in_for_torchs_header_build(tmp_path):
    """torch names its precompiled header only after the hold has run: a pack unpacked
    during the wait (the prefetch thread finishing) is placed under torch's local name,
    so torch finds the `.gch` and runs no g++ for it."""
    from torch._inductor import codecache

    rec = relocate.KeyRecorder()
    content, extra = "#include <torch/csrc/inductor/cpp_prefix.h>\n", flags("/t", "/p")
    shipped = tmp_path / "pack" / "cshipped.h.gch"
    shipped.parent.mkdir()
    shipped.write_bytes(b"precompiled header")
    waits: list[int] = []

    def toolchain_arrives() -> None:
        waits.append(1)
        rec.learn(tmp_path / "pack", {"cshipped.h.gch": relocate.identity(content, "h", extra)})

    rec.install()
    try:
        assert rec.hold_headers(toolchain_arrives)
        codecache.write("// a kernel\n", "main.cpp", extra, specified_dir=str(tmp_path / "k"))
        assert waits == []  # kernels' sources do not wait, only the header
        _, local = codecache.write(content, "h", extra, specified_dir=str(tmp_path / "hdr"))
    finally:
        rec.uninstall()
    assert waits == [1]
    assert Path(local + ".gch").read_bytes() == b"precompiled header"
    assert not relocate.KeyRecorder().hold_headers(toolchain_arrives)  # not in torch: no hold


# -- end to end -----------------------------------------------------------------------------

def other_torch_path(root: Path) -> dict[str, str]:
    """PYTHONPATH that imports this venv's torch from another directory (a symlink)."""
    site = root / "other-prefix" / "site-packages"
    site.mkdir(parents=True)
    (site / "torch").symlink_to(Path(torch.__file__).resolve().parent)
    return {"PYTHONPATH": str(site)}


def job(machine: Machine, gxx: GxxCounter, url: str, env: dict[str, str] | None = None
        ) -> JobRun:
    run = run_job(machine, "--model", "mlp", "--steps", "2", "--megacache", "explicit",
                  "--name", "relocate-mlp", "--code", "v1",
                  env={"MEGACACHE_URL": url, "CXX": "g++", **(env or {})}, gxx=gxx,
                  timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def kernel_names(machine: Machine) -> set[str]:
    return {p.name for p in (machine.root / "inductor").rglob("*.main.so")}


@pytest.mark.e2e
def test_consumer_with_torch_at_another_path_starts_warm_without_thrash(tmp_path, toolchain):
    gxx = GxxCounter(tmp_path / "bin")
    server = ServerProcess(tmp_path / "data").start()
    try:
        # its header is built at its own torch's path (the toolchain's), as a cold build's
        producer = Machine(tmp_path / "producer", toolchain)
        cold = job(producer, gxx, server.url)
        assert cold.mc["published"] and cold.gxx_builds > 0, cold.mc
        entry = httpx.get(f"{server.url}/v1/ac/{cold.mc['key']}").json()

        elsewhere = Machine(tmp_path / "elsewhere")
        run = job(elsewhere, gxx, server.url, env=other_torch_path(tmp_path))
        assert run.mc["outcome"] == "hit" and not run.mc["skipped"], run.mc
        c = run.result["counters"]  # graphs from the cache: Inductor's, AOT's or Dynamo's
        assert c["fxgraph_hit"] + c["aot_hit"] + run.result["precompile_hit"] > 0, run.result
        # torch really keyed its kernels differently here: the shipped ones were re-keyed
        assert kernel_names(elsewhere) - kernel_names(producer)
        assert run.gxx_builds == 0, "torch at another path must reuse the shipped kernels"
        assert not run.mc["published"], run.mc["publish_reason"]

        again = job(Machine(tmp_path / "original"), gxx, server.url)
        assert again.gxx_builds == 0 and again.mc["outcome"] == "hit"
        after = httpx.get(f"{server.url}/v1/ac/{cold.mc['key']}").json()
        assert after == entry, "the entry must not be re-published by either consumer"
    finally:
        server.stop()
