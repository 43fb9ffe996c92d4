"""The job is the unit: every rank of a job attempt gets the same resolution whatever is
published between their lookups, a restart (a new attempt) resolves afresh, a cold
fleet's publishers upload a key's bundle once, a dead claimant's key is taken over when its
lease runs out, and a publisher that skipped its upload adds what the claimant's entry
lacks.

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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import need
from helpers import ServerProcess

from benchmarks.harness.machines import Machine

pytestmark = pytest.mark.e2e

need("torch", "fleet tests load real Mega-Cache bundles into torch")

MODEL, CODE = "fleet-model", "fleet-v1"

BUNDLE = textwrap.dedent("""
    import sys, torch
    from megacache_client.torch import megacache_io
    scale = float(sys.argv[2])
    torch.compile(lambda x: (x * scale).sin())(torch.ones(4))
    raw, _ = megacache_io.save_bundle()
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
def bundles(tmp_path_factory: pytest.TempPathFactory, toolchain: Path) -> list[Path]:
    """Two real bundles of different graphs: two versions of one entry (each compiled on a
    machine of its own whose toolchain is built: a bundle carries no toolchain)."""
    root = tmp_path_factory.mktemp("bundles")
    made = []
    for version in (1, 2):
        path = root / f"v{version}.bin"
        env = {**os.environ, **Machine(root / f"m{version}", toolchain).env()}
        env.pop("MEGACACHE_URL", None)
        out = subprocess.run([sys.executable, "-c", BUNDLE, str(path), str(version + 0.5)],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        made.append(path)
    return made


def push(server: ServerProcess, bundle: Path, tmp_path: Path, model: str = MODEL) -> str:
    """`megacache push`; the key it wrote (a trainer's: precompiled Dynamo on)."""
    out = subprocess.run([str(Path(sys.executable).with_name("megacache")), "push", str(bundle),
                          "--model", model, "--code", CODE, "--url", server.url],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "push")})
    assert out.returncode == 0, out.stderr
    return out.stdout.split("pushed ", 1)[1].split()[0]


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

    from megacache_client.torch.packs import compress_bytes

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
    uploads, the others skip with the reason (then find nothing to add); the entry is there
    once."""
    from megacache_client.config import ClientConfig
    from megacache_client.results import LoadResult, Snapshot, Track
    from megacache_client.steps.claims import claim_holder
    from megacache_client.steps.fingerprint import compute
    from megacache_client.steps.publish import upload
    from megacache_client.transport.client import RemoteCache
    from megacache_client.transport.nodecache import NodeCache

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
    # each waited for the claimant's entry and found its own bytes there: nothing to add
    assert all(r.endswith("the claimant's entry already has everything this run compiled")
               for r in skipped), skipped
    with RemoteCache(ClientConfig.from_env({"MEGACACHE_URL": server.url})) as remote:
        assert remote.get_entry(fp.key()) is not None


# -- a claimant that dies, and publishers that add what its entry lacks --------------------
CLAIMANT = textwrap.dedent("""
    import json, os, sys
    from megacache_client.config import ClientConfig
    from megacache_client.wire.manifest import Fingerprint
    from megacache_client.transport.nodecache import NodeCache
    from megacache_client.steps.publish import upload
    from megacache_client.results import LoadResult, Snapshot, Track
    from megacache_client.wire.schema import parse
    config = ClientConfig.from_env()
    track = Track(parse(Fingerprint, json.loads(sys.argv[1])), LoadResult(outcome="miss"))
    snap = Snapshot(raw=os.urandom(int(sys.argv[2])), counts={}, kernels={}, compile_s=1.0,
                    tracks=[track])
    upload(snap, config, NodeCache(config.node_cache_dir, 60), track, sys.argv[3])
    print(track.publish)
""")


def publisher(url: str, node: Path, **settings: str) -> tuple[Any, Any]:
    """A publisher's config and node cache, as a node of its own would have them."""
    from megacache_client.config import ClientConfig
    from megacache_client.transport.nodecache import NodeCache

    config = ClientConfig.from_env({"MEGACACHE_URL": url, "MEGACACHE_NODE_CACHE_DIR": str(node),
                                    "MEGACACHE_SHIP_TOOLCHAIN": "0", **settings})
    return config, NodeCache(config.node_cache_dir, 60)


def publish_now(url: str, node: Path, fp: Any, raw: bytes, **settings: str) -> Any:
    """One publisher of `raw` under `fp` (a first publish: it claims the key); its result."""
    from megacache_client.results import LoadResult, Snapshot, Track
    from megacache_client.steps.claims import claim_holder
    from megacache_client.steps.publish import upload

    config, cache = publisher(url, node, **settings)
    track = Track(fp, LoadResult(outcome="miss"))
    snap = Snapshot(raw=raw, counts={}, kernels={}, compile_s=1.0, tracks=[track])
    upload(snap, config, cache, track, claim_holder())
    return track.publish


def until(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def held_claims(server: ServerProcess) -> float:
    """How many publish claims the server refused so far (its Prometheus counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "megacache_publish_claims_total" and s.labels == {"result": "held"})


def entry_bundle(url: str, key: str, node: Path) -> tuple[Any, bytes]:
    """The entry at `key` and its bundle's bytes, downloaded and verified as a load does."""
    from megacache_client.steps.fetch import fetch_blob
    from megacache_client.steps.load import read_bundle
    from megacache_client.transport.client import RemoteCache

    config, cache = publisher(url, node)
    with RemoteCache(config) as remote:
        got = remote.get_entry(key)
        assert got is not None, f"no entry at {key}"
        ref = got.manifest.blob("megacache")
        assert ref is not None
        path, _ = fetch_blob(remote, cache, ref)
        bundle = remote.gate.admit(got, "megacache", path)
    return got.manifest, read_bundle(bundle, config.max_raw_bytes)


def test_a_dead_claimants_key_is_taken_over_after_its_lease(tmp_path):
    """kill -9 of the claimant mid-upload: a publisher right after it skips (the claim is
    live, held by the dead one); one that waits takes the key over when the lease runs
    out and publishes; its entry loads, and the store holds only what the entry names."""
    from helpers import SlowLink, make_fingerprint

    lease = 4.0
    server = ServerProcess(tmp_path / "data").start()
    try:
        fp = make_fingerprint(model="fleet-takeover", code="v1")
        key, holder = fp.key(), "dying-claimant-1"
        with SlowLink(server.port, rate=2 << 20) as slow:  # 2 MiB/s: a 32 MiB upload crawls
            env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
            claimant = subprocess.Popen(
                [sys.executable, "-c", CLAIMANT, json.dumps(fp.to_dict()), str(32 << 20),
                 holder],
                env={**env, "MEGACACHE_URL": slow.url, "MEGACACHE_CLAIM_LEASE_S": str(lease),
                     "MEGACACHE_SHIP_TOOLCHAIN": "0",
                     "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "dying")},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                until("the claimant's upload to start", server.temp_files, timeout=30)
                probe = httpx.post(f"{server.url}/v1/ac/{key}/claim",
                                   json={"holder": "probe", "lease_s": 60})
                assert probe.status_code == 409, probe.text  # it holds the claim, uploading
                held = probe.json()["error"]
                assert held["holder"] == holder and held["remaining_s"] <= lease, held
            finally:
                claimant.kill()
                out, err = claimant.communicate(timeout=30)
            assert claimant.returncode == -9 and not out, (out, err[-2000:])
        # its partial upload is dropped as the connection breaks, never stored
        until("the killed upload's temp file to go", lambda: not server.temp_files())
        assert server.blob_names() == []

        skipped = publish_now(server.url, tmp_path / "b", fp, os.urandom(1 << 20),
                              MEGACACHE_PUBLISH_WAIT_S="0")
        assert time.time() < held["expires_at"], "the lease ran out before the test looked"
        assert not skipped.published and skipped.bytes_up == 0, skipped
        assert f"another publisher ({holder}) is publishing this key: upload skipped" \
            in skipped.reason and "did not appear within publish_wait_s" in skipped.reason

        raw = os.urandom(1 << 20)
        taker = publish_now(server.url, tmp_path / "c", fp, raw,
                            MEGACACHE_PUBLISH_WAIT_S="30")
        assert time.time() >= held["expires_at"]  # it waited for the lease to run out
        assert taker.published and taker.bytes_up > 0, taker
        assert taker.reason.startswith(f"the claim of {holder} lapsed with no entry written: "
                                       "took the key over and published"), taker.reason
        entry, bundle = entry_bundle(server.url, key, tmp_path / "reader")
        assert bundle == raw  # the entry loads: its bundle downloads and verifies
        # nothing left referenced by nothing: the store holds exactly the entry's blobs
        assert server.temp_files() == []
        assert server.blob_names() == sorted(b.digest for b in entry.blobs)
        assert "deleted 0 blobs" in server.cli("gc")
        assert server.cli("fsck").splitlines()[-1] == "clean"
        assert server.blob_names() == sorted(b.digest for b in entry.blobs)
        assert httpx.post(f"{server.url}/v1/ac/{key}/claim",  # the taker let go of the key
                          json={"holder": "after", "lease_s": 1}).status_code == 200
    finally:
        server.stop()


def test_a_claim_held_by_a_gone_process_of_this_host_is_released_at_once(server, tmp_path):
    """A process SIGKILLed during its publish leaves its claim for the lease (10 min); its
    restart on the same node, whose exit would wait `publish_wait_s` for an upload that
    never comes, sees the holder was a process of this host that is gone and takes the key
    now. A holder still running, or of another host, keeps it."""
    from helpers import make_fingerprint

    from megacache_client.steps.claims import claim_holder

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host = claim_holder().rsplit("-", 2)[0]
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for holder, taken in ((f"{host}-{int(gone.stdout)}-0badc0de", True),
                              (f"{host}-{alive.pid}-0badc0de", False),
                              (f"elsewhere-{int(gone.stdout)}-0badc0de", False)):
            fp = make_fingerprint(model="fleet-gone", code=holder)
            held = httpx.post(f"{server.url}/v1/ac/{fp.key()}/claim",
                              json={"holder": holder, "lease_s": 600})
            assert held.status_code == 200, held.text
            result = publish_now(server.url, tmp_path / holder, fp, os.urandom(1 << 16),
                                 MEGACACHE_PUBLISH_WAIT_S="0")
            assert result.published is taken, (holder, result.reason)
    finally:
        alive.kill()
        alive.wait()


def test_a_skipped_publisher_adds_what_the_claimants_entry_lacks(server, bundles, tmp_path):
    """B compiled other graphs than the claimant: it skips the upload, waits for the
    claimant's entry, then adds its graphs to it (uploading only its merged bundle); a
    publisher whose graphs the entry already has adds nothing."""
    import torch

    from megacache_client.steps.fingerprint import compute
    from megacache_client.torch import megacache_io

    model = "fleet-follow"
    with torch._dynamo.config.patch(caching_precompile=True):  # keyed as a trainer's
        fp = compute(model=model, code=CODE)
    key = fp.key()
    claim = httpx.post(f"{server.url}/v1/ac/{key}/claim",
                       json={"holder": "test-claimant", "lease_s": 120})
    assert claim.status_code == 200, claim.text
    v1, v2 = (megacache_io.read_artifacts(b.read_bytes()) for b in bundles)
    keys = [{(kind, k) for kind, ks in megacache_io.keys_of(a).items() for k in ks}
            for a in (v1, v2)]
    assert keys[0] and keys[1] and not keys[1] <= keys[0]  # the premise: other graphs

    refused = held_claims(server)
    results: list[Any] = []
    b = threading.Thread(target=lambda: results.append(publish_now(
        server.url, tmp_path / "b", fp, bundles[1].read_bytes(),
        MEGACACHE_PUBLISH_WAIT_S="120")))
    b.start()
    # B claimed and was refused, then looked again (no entry, the claim still held): it
    # waits. Two refusals of the claim on the server's counter show it, within a deadline.
    until("B to find the claim held twice", lambda: held_claims(server) >= refused + 2)
    assert b.is_alive() and not results
    assert push(server, bundles[0], tmp_path, model=model) == key  # the claimant's entry
    b.join(timeout=120)
    assert not b.is_alive()
    added = results[0]
    assert added.published and added.bytes_up > 0, added
    assert "another publisher (test-claimant) is publishing this key: upload skipped; " \
        "added to the claimant's entry what this run compiled and it lacked: " \
        f"{len(keys[1] - keys[0])} artifact(s)" in added.reason, added.reason
    entry, raw = entry_bundle(server.url, key, tmp_path / "reader")
    merged = megacache_io.read_artifacts(raw)
    assert merged is not None
    held = {(kind, k) for kind, ks in megacache_io.keys_of(merged).items() for k in ks}
    assert held == keys[0] | keys[1]
    assert [b.role for b in entry.blobs] == ["megacache"]

    # the claimant's own graphs: nothing to add, the entry is left as it is
    etag = httpx.get(f"{server.url}/v1/ac/{key}").headers["etag"]
    again = publish_now(server.url, tmp_path / "c", fp, bundles[0].read_bytes())
    assert not again.published and again.bytes_up == 0, again
    assert again.reason == ("another publisher (test-claimant) is publishing this key: upload "
                            "skipped; the claimant's entry already has everything this run "
                            "compiled"), again.reason
    assert httpx.get(f"{server.url}/v1/ac/{key}").headers["etag"] == etag
    httpx.delete(f"{server.url}/v1/ac/{key}/claim", params={"holder": "test-claimant"})


# -- a real two-node torchrun job ---------------------------------------------------------

TWO_NODE_JOB = Path(__file__).resolve().parent / "two_node_job.py"


def two_nodes(server: ServerProcess, tmp_path: Path, model: str,
              between: Callable[[], None]) -> list[dict]:
    """A real two-node job on loopback: two `torchrun --nnodes 2 --nproc-per-node 2`
    launches meeting at one c10d rendezvous, gloo, each node with its own node cache and
    torch caches. Node B's ranks look up only after `between()` ran, which the test calls
    once both of node A's ranks have looked. Returns the four ranks' results."""
    from helpers import free_port

    job, port = f"two-nodes-{model}", free_port()
    results, flag = tmp_path / "results", tmp_path / "node-a-looked"
    results.mkdir()

    def launch(node: str) -> subprocess.Popen[str]:
        root = tmp_path / node
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MEGACACHE_", "TORCHELASTIC_", "SLURM_"))}
        env.update({"MEGACACHE_URL": server.url, "MEGACACHE_NODE_CACHE_DIR": str(root / "mc"),
                    "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "OMP_NUM_THREADS": "1",
                    "JOB_MODEL": model, "JOB_CODE": CODE, "RESULT_DIR": str(results),
                    "NODE_NAME": node, **({"WAIT_FOR": str(flag)} if node == "b" else {})})
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
             "--rdzv-conf", f"is_host={int(node == 'a')}", str(TWO_NODE_JOB)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    nodes = [launch("a"), launch("b")]
    try:
        until("node A's ranks to look up", lambda: len([
            p for p in results.glob("rank*.json")
            if json.loads(p.read_text())["node"] == "a"]) == 2 or None, timeout=300)
        between()
        flag.touch()
        outs = [n.communicate(timeout=300) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for n, (_, err) in zip(nodes, outs, strict=True):
        assert n.returncode == 0, err[-4000:]
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], ranks
    return ranks


def test_two_torchrun_nodes_agree_when_an_entry_appears_between_their_lookups(
        server, bundles, tmp_path):
    model = "two-nodes-appears"

    def publish_then_wait() -> None:
        push(server, bundles[0], tmp_path, model=model)
        # node B's ranks enabled megacache at `import torch` (zero-code) and look up only
        # now, longer after it than the 10 s load deadline: as after a long trainer set-up
        time.sleep(11)

    ranks = two_nodes(server, tmp_path, model, publish_then_wait)
    assert {(r["outcome"], r["bundle"]) for r in ranks} == {("miss", None)}, ranks
    assert all("attempt 0" in r["reason"] for r in ranks), ranks


def test_two_torchrun_nodes_agree_when_the_entry_is_replaced_between_their_lookups(
        server, bundles, tmp_path):
    model = "two-nodes-replaced"
    push(server, bundles[0], tmp_path, model=model)
    ranks = two_nodes(server, tmp_path, model, lambda: push(server, bundles[1], tmp_path,
                                                             model=model))
    # one answer for the job: the version node A got (an exact hit, or the same entry as a
    # fallback: torchrun's ranks fingerprint their compile config a little differently from
    # `megacache push`), never node B's newer one
    answers = {(r["outcome"], r["bundle"]) for r in ranks}
    assert len(answers) == 1, ranks
    answer = answers.pop()
    assert answer[0] in ("hit", "fallback") and answer[1] == digest_of(bundles[0]), ranks
