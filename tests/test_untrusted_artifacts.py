"""An untrusted writer's bytes never reach a trusted consumer's caches, by any client path.

A namespace member that is not a trusted writer (`MEGACACHE_TRUSTED_WRITERS=ci-*`) stores
entries whose bundle, kernels and toolchain blobs are its own marker files: one at the
consumer's exact key, one of an unrelated model (its toolchain pack is what the prefetch's
listing once handed to the header folder unchecked). Real trainers then start as new
machines, zero-code, through every path the client has: the prefetch (the model's entry and
a toolchain pack), the exact lookup, the job attempt's resolution, the fallback to the
model's newest entry, and the publish at exit that reuses a stored toolchain pack. None of
the writer's bytes may land in Inductor's cache, TMPDIR (the headers), or the node cache,
and nothing the consumer publishes may name them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess, sha256

from benchmarks.harness.machines import GxxCounter, JobRun, Machine, run_job
from megacache_client.torch.packs import write_pack
from megacache_client.wire.manifest import BlobRef, Manifest, sha256_file

pytestmark = pytest.mark.e2e

need("torch", "the consumers are real torch.compile trainers")

NS, MODEL = "team", "tiny-mlp"
MARKER = b"UNTRUSTED-WRITER-MARKER-" + os.urandom(8).hex().encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(tmp_path_factory.mktemp("untrusted") / "data", "--auth").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def _job(machine: Machine, gxx: GxxCounter, server: ServerProcess, token: str, code: str,
         **env: str) -> JobRun:
    run = run_job(machine, "--model", "mlp", "--steps", "2", "--megacache", "env", env={
        "MEGACACHE_URL": server.url, "MEGACACHE_TOKEN": token, "MEGACACHE_NAMESPACE": NS,
        "MEGACACHE_MODEL": MODEL, "MEGACACHE_CODE": code, **env}, gxx=gxx, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def _marker_pack(tmp: Path, role: str, names: list[str], like: BlobRef) -> tuple[BlobRef, bytes]:
    """A pack of the writer's own files, with the build facts of a real pack (so that only
    who wrote it can refuse it, not the machine it was built for)."""
    files = {}
    for name in names:
        path = tmp / f"{role}-{name.replace('/', '_')}"
        path.write_bytes(MARKER * 64)
        files[name] = path
    dest = tmp / f"{role}.pack"
    raw_size, size = write_pack(files.items(), dest)
    data = dest.read_bytes()
    return BlobRef(digest=sha256_file(dest), size=size, role=role, compression="zstd",
                   raw_size=raw_size, meta=dict(like.meta)), data


@pytest.fixture(scope="module")
def poisoned(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory,
             toolchain: Path) -> tuple[set[str], str]:
    """The untrusted writer's entries; returns their blobs' digests and the consumer token."""
    tmp = tmp_path_factory.mktemp("writer")
    gxx = GxxCounter(tmp / "bin")
    writer = server.token("read,write", namespace=NS, name="trainer-w")
    consumer = server.token("read,write", namespace=NS, name="ci-consumer")
    real = _job(Machine(tmp / "m", toolchain), gxx, server, writer, "v1")  # one to imitate
    assert real.mc["published"], real.mc
    h = httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {writer}"},
                     timeout=30)
    got = h.get(f"/v1/ac/{real.mc['key']}")
    entry = Manifest.from_json(got.content)
    bundle = MARKER * 1000
    blobs = [BlobRef(digest=sha256(bundle), size=len(bundle), role="megacache",
                     compression="none")]
    stored = {blobs[0].digest: bundle}
    for role, names in (("kernels", ["ev/evil.so"]), ("toolchain", ["evil.h", "evil.h.gch"])):
        like = entry.blob(role)
        assert like is not None, f"the real entry has no {role} pack to imitate"
        ref, data = _marker_pack(tmp, role, names, like)
        blobs.append(ref)
        stored[ref.digest] = data
    for digest, data in stored.items():
        assert h.put(f"/v1/cas/{digest}", content=data).status_code in (200, 201)
    # the consumer's exact key, and an unrelated model of the same env and hw
    exact = entry.replace(blobs=blobs)
    other_fp = dataclasses.replace(exact.fingerprint, model="unrelated-model")
    other = exact.replace(key=other_fp.key(), fingerprint=other_fp,
                          blobs=[b for b in blobs if b.role != "kernels"])
    assert h.put(f"/v1/ac/{exact.key}", content=exact.to_json(),
                 headers={"if-match": got.headers["etag"]}).status_code == 200
    assert h.put(f"/v1/ac/{other.key}", content=other.to_json()).status_code == 201
    return set(stored), consumer


def _landed(machine: Machine, digests: set[str]) -> list[str]:
    """Every file of `machine` that is one of the writer's blobs or holds its marker."""
    found = []
    for path in machine.root.rglob("*"):
        if not path.is_file() or path.name.startswith("gxx-"):
            continue
        if path.name in digests or MARKER in path.read_bytes():
            found.append(str(path.relative_to(machine.root)))
    return found


def test_no_byte_of_an_untrusted_writer_lands_by_any_client_path(
        server: ServerProcess, poisoned: tuple[set[str], str], tmp_path: Path) -> None:
    digests, consumer = poisoned
    gxx = GxxCounter(tmp_path / "bin")
    trusted = {"MEGACACHE_TRUSTED_WRITERS": "ci-*"}
    # 1. a model nobody published: the prefetch looks for any toolchain pack of this env
    #    and hw, and the listing nominates the writer's; the publish looks for one to reuse
    fresh = Machine(tmp_path / "fresh")
    run_fresh = _job(fresh, gxx, server, consumer, "v1", MEGACACHE_MODEL="fresh-model",
                     **trusted)
    assert run_fresh.mc["outcome"] == "miss", run_fresh.mc
    # 2. the fallback path: no entry of its own code, the model's newest is the writer's
    a = Machine(tmp_path / "a")
    run_a = _job(a, gxx, server, consumer, "v2", **trusted)
    assert run_a.mc["outcome"] == "miss", run_a.mc
    # 3. a job attempt's resolution of the exact key the writer holds (then a fallback to
    #    the consumer's own v2 entry); its publish replaces the writer's entry
    b = Machine(tmp_path / "b")
    run_b = _job(b, gxx, server, consumer, "v1", MEGACACHE_JOB_ID="job-7", **trusted)
    assert run_b.mc["outcome"] in ("miss", "fallback"), run_b.mc
    assert run_b.mc["published"], run_b.mc
    for machine in (fresh, a, b):
        assert _landed(machine, digests) == [], machine.root
    # what the consumers published names none of the writer's blobs
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"authorization": f"Bearer {consumer}"}) as h:
        for run in (run_fresh, run_a, run_b):
            published = Manifest.from_json(h.get(f"/v1/ac/{run.mc['key']}").content)
            assert not {b.digest for b in published.blobs} & digests, published
