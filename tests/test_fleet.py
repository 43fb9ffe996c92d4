"""The job is the unit: every rank of a job attempt gets the same resolution whatever is
published between their lookups, a restart (a new attempt) resolves afresh, and a cold
fleet's publishers upload a key's bundle once.

Real client processes (the zero-code path's `enable`, real fingerprinting and loading into
torch), a real server on loopback, real bundles from torch.compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need
from helpers import ServerProcess

pytestmark = pytest.mark.e2e

need("torch", "fleet tests load real Mega-Cache bundles into torch")

MODEL, CODE = "fleet-model", "fleet-v1"

BUNDLE = textwrap.dedent("""
    import sys, torch
    from megacache_client import torch_env
    scale = float(sys.argv[2])
    torch.compile(lambda x: (x * scale).sin())(torch.ones(4))
    raw, _ = torch_env.save_bundle()
    open(sys.argv[1], "wb").write(raw)
""")

RANK = textwrap.dedent("""
    import json, megacache_client
    session = megacache_client.enable(model=%r, code=%r, load_now=True)
    r = session.load_result
    bundle = r.entry.blob("megacache") if r.entry is not None else None
    print(json.dumps({"outcome": r.outcome, "reason": r.reason, "job_note": r.job_note,
                      "bundle": bundle.digest if bundle else None}))
    session.close()  # reports the run: the job's attempt counts once, whatever the ranks
""") % (MODEL, CODE)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("fleet") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two real bundles of different graphs: two versions of one entry."""
    root = tmp_path_factory.mktemp("bundles")
    made = []
    for version in (1, 2):
        path = root / f"v{version}.bin"
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / f"ind{version}")}
        env.pop("MEGACACHE_URL", None)
        out = subprocess.run([sys.executable, "-c", BUNDLE, str(path), str(version + 0.5)],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        made.append(path)
    return made


def push(server: ServerProcess, bundle: Path, tmp_path: Path) -> None:
    out = subprocess.run([str(Path(sys.executable).with_name("megacache")), "push", str(bundle),
                          "--model", MODEL, "--code", CODE, "--url", server.url],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "push")})
    assert out.returncode == 0, out.stderr


def rank(server: ServerProcess, tmp_path: Path, name: str, **job: str) -> dict:
    """One process of a job on a node of its own (its own node cache and torch caches)."""
    root = tmp_path / name
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEGACACHE_", "TORCHELASTIC_", "SLURM_"))}
    env.update({"MEGACACHE_URL": server.url, "MEGACACHE_NODE_CACHE_DIR": str(root / "node"),
                "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), **job})
    out = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def digest_of(bundle: Path) -> str:
    import hashlib

    from megacache_client.packs import compress_bytes

    return hashlib.sha256(compress_bytes(bundle.read_bytes())).hexdigest()


def test_ranks_agree_when_an_entry_appears_between_their_lookups(server, bundles, tmp_path):
    job = {"MEGACACHE_JOB_ID": "fleet-appears", "MEGACACHE_ATTEMPT": "0"}
    first = rank(server, tmp_path, "a", RANK="0", **job)
    assert first["outcome"] == "miss", first
    push(server, bundles[0], tmp_path)  # published between node A's and node B's lookups
    alone = rank(server, tmp_path, "alone")  # a process of no job sees it: the premise
    assert alone["outcome"] == "hit" and alone["bundle"] == digest_of(bundles[0]), alone
    second = rank(server, tmp_path, "b", RANK="8", **job)
    assert (second["outcome"], second["bundle"]) == ("miss", None), second
    assert "job fleet-appears attempt 0" in second["reason"]
    restart = rank(server, tmp_path, "restart", RANK="0",
                   MEGACACHE_JOB_ID="fleet-appears", MEGACACHE_ATTEMPT="1")
    assert restart["outcome"] == "hit", restart  # a new attempt finds what was published
    import httpx

    jobs = httpx.get(f"{server.url}/v1/jobs").json()["jobs"]
    job = next(j for j in jobs if j["job_id"] == "fleet-appears")
    attempts = {a["attempt"]: a for a in job["attempts"]}
    assert sorted(attempts) == [0, 1] and job["restarts"] == 1, job
    assert attempts[0]["reports"] == 2 and attempts[0]["outcome"] == "miss", attempts


def test_ranks_agree_when_the_entry_is_replaced_between_their_lookups(server, bundles,
                                                                      tmp_path):
    push(server, bundles[0], tmp_path)
    job = {"TORCHELASTIC_RUN_ID": "fleet-replaced", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = rank(server, tmp_path, "a", RANK="0", **job)
    assert first["outcome"] == "hit" and first["bundle"] == digest_of(bundles[0]), first
    push(server, bundles[1], tmp_path)  # a new version replaces it
    alone = rank(server, tmp_path, "alone")
    assert alone["bundle"] == digest_of(bundles[1]), alone
    second = rank(server, tmp_path, "b", RANK="1", **job)
    assert (second["outcome"], second["bundle"]) == ("hit", first["bundle"]), second


def test_a_cold_fleet_uploads_the_bundle_once(server, tmp_path):
    """8 publishers of one new key at once, each with its own node cache: one claims and
    uploads, the others skip with the reason; the entry is there once."""
    from megacache_client.config import ClientConfig
    from megacache_client.fingerprint import compute
    from megacache_client.nodecache import NodeCache
    from megacache_client.publish import claim_holder, upload
    from megacache_client.results import LoadResult, Snapshot, Track
    from megacache_client.transport import RemoteCache

    raw = os.urandom(4 << 20)  # bytes the server has never seen (nothing is loaded here)
    fp = compute(model="fleet-cold", code="v1")
    start = threading.Barrier(8)
    tracks: list[Track] = []

    def publisher(i: int) -> None:
        config = ClientConfig.from_env({"MEGACACHE_URL": server.url,
                                        "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / f"n{i}"),
                                        "MEGACACHE_SHIP_TOOLCHAIN": "0"})
        track = Track(fp, LoadResult(outcome="miss"))
        tracks.append(track)
        snap = Snapshot(raw=raw, counts={}, kernels={}, compile_s=1.0, tracks=[track])
        start.wait(timeout=60)
        upload(snap, config, NodeCache(config.node_cache_dir, 60), track, claim_holder())

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    uploaded = [t for t in tracks if t.publish.bytes_up > 0]
    published = [t for t in tracks if t.publish.published]
    assert len(uploaded) == 1 and len(published) == 1, [t.publish for t in tracks]
    skipped = [t.publish.reason for t in tracks if not t.publish.published]
    assert len(skipped) == 7 and all("upload skipped" in r for r in skipped), skipped
    with RemoteCache(ClientConfig.from_env({"MEGACACHE_URL": server.url})) as remote:
        assert remote.get_entry(fp.key()) is not None
