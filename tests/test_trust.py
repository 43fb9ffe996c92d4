"""Reports heal the store, the scrub finds rot first, and every entry says who wrote it.

Real servers on every backend pair. Bit rot is made by rewriting a stored blob behind the
server's back; a read-only reader reports it, the server re-verifies, quarantines, stops
offering every entry naming it, and a republish replaces it. A hostile tenant reporting
another's good blobs changes nothing and is rate-limited. With the scrub on and no client at
all, rot is found within the scrub's byte budget.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args, need
from helpers import ServerProcess, functions_job, make_fingerprint, make_manifest, sha256
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness.machines import GxxCounter, Machine
from megacache_client.config import ClientConfig
from megacache_client.job import JobIdentity
from megacache_client.results import LoadResult, Snapshot, Track
from megacache_client.steps.fetch import find_entry
from megacache_client.steps.publish import upload
from megacache_client.transport.client import RemoteCache
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire.manifest import Fingerprint, component_digest


@pytest.fixture(scope="module", params=BACKENDS)
def trusted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("trust") / "data", *args, "--auth",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_REPORT_RATE": "0.2",
             "MEGACACHE_REPORT_BURST": "5", "MEGACACHE_WITHDRAW_AFTER_REPORTS": "3"}),
        request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


class Team:
    """A tenant with a write token, and a read-only token (a trainer) of the same namespace."""

    def __init__(self, server: ServerProcess, namespace: str) -> None:
        self.server = server
        self.namespace = namespace
        self.http = httpx.Client(base_url=server.url, timeout=30, headers=_bearer(
            server.token("read,write", namespace=namespace, name=f"ci-{namespace}")))
        self.reader = httpx.Client(base_url=server.url, timeout=30, headers=_bearer(
            server.token("read", namespace=namespace, name=f"trainer-{namespace}")))

    def upload(self, data: bytes) -> str:
        r = self.http.put(f"/v1/cas/{sha256(data)}", content=data)
        assert r.status_code in (200, 201), r.text
        return sha256(data)

    def publish(self, code: str, data: bytes | None = None) -> tuple[str, str, bytes]:
        data = data if data is not None else os.urandom(50_000)
        digest = self.upload(data)
        m = make_manifest({"megacache": data}, make_fingerprint(code=code,
                                                                namespace=self.namespace))
        r = self.http.put(f"/v1/ac/{m.key}", content=m.to_json(),
                          headers={"if-none-match": "*"})
        assert r.status_code == 201, r.text
        return m.key, digest, m.to_json()

    def close(self) -> None:
        self.http.close()
        self.reader.close()


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def team(trusted: ServerProcess) -> Iterator[Team]:
    t = Team(trusted, f"t-{os.urandom(3).hex()}")
    yield t
    t.close()


def _rot(server: ServerProcess, digest: str) -> None:
    data = bytearray(server.read_stored(digest))
    data[len(data) // 2] ^= 0xFF
    server.write_stored(digest, bytes(data))


def _quarantined_aside(server: ServerProcess, digest: str) -> bytes:
    if server.s3_endpoint:
        return bytes(server._s3().get_object(Bucket=server.s3_bucket,
                                             Key=f"quarantine/{digest}")["Body"].read())
    return (server.data_dir / "quarantine" / digest).read_bytes()


def _metric(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_a_report_of_rot_quarantines_the_blob_and_a_republish_replaces_it(team: Team):
    key, digest, manifest = team.publish("rot")
    keep_key, _, _ = team.publish("healthy")
    _rot(team.server, digest)
    rotten = team.server.read_stored(digest)

    r = team.reader.post(f"/v1/cas/{digest}/report",
                         json={"kind": "digest", "entry_key": key, "detail": "sha mismatch"})
    assert r.status_code == 200, r.text
    assert r.json() == {"verdict": "quarantined", "reason": "digest"}

    # no longer offered: lookup, listing, blob reads
    assert team.reader.get(f"/v1/ac/{key}").status_code == 404
    listed = [e["key"] for e in team.reader.get("/v1/ac", params={"limit": 100}).json()["entries"]]
    assert key not in listed and keep_key in listed
    assert team.reader.get(f"/v1/cas/{digest}").status_code == 404
    assert team.reader.head(f"/v1/cas/{digest}").status_code == 404
    assert team.reader.get(f"/v1/ac/{keep_key}").status_code == 200
    # kept aside for inspection, out of the store's own listing
    assert _quarantined_aside(team.server, digest) == rotten
    assert digest not in team.server.blob_names()

    # visible, with its reason, in the quarantine list, stats, dashboard, /metrics, the log
    records = team.reader.get("/v1/quarantine").json()["quarantined"]
    mine = [q for q in records if q["digest"] == digest]
    assert mine and mine[0]["reason"] == "digest"
    assert mine[0]["reporter"] == f"trainer-{team.namespace}"
    assert mine[0]["withdrawn"] == [f"{team.namespace}/{key}"]
    stats = team.reader.get("/v1/stats").json()["quarantine"]
    assert stats["by_reason"].get("digest") == 1
    dash = team.reader.get("/v1/dashboard").json()["quarantine"]
    assert dash[0]["digest"] == digest
    series = _metric(team.reader.get("/metrics").text, "megacache_quarantined_blobs_total")
    assert series[(("reason", "digest"),)] == 1
    assert f"quarantined blob {digest} (reason digest" in team.server.log()

    # the next publish of the key replaces it (If-None-Match: * included)
    data = os.urandom(50_000)
    m = make_manifest({"megacache": data}, make_fingerprint(code="rot",
                                                            namespace=team.namespace))
    assert m.key == key
    team.upload(data)
    r = team.http.put(f"/v1/ac/{key}", content=m.to_json(), headers={"if-none-match": "*"})
    assert r.status_code == 201, r.text
    assert team.reader.get(f"/v1/ac/{key}").status_code == 200
    # and the very same bytes, uploaded again, are served again
    assert manifest  # the original manifest names the quarantined digest
    assert team.http.put(f"/v1/ac/{key}", content=manifest).status_code == 424


def test_the_same_bytes_uploaded_again_after_quarantine_are_offered_again(team: Team):
    data = os.urandom(40_000)
    key, digest, manifest = team.publish("again", data)
    _rot(team.server, digest)
    assert team.reader.post(f"/v1/cas/{digest}/report",
                            json={"kind": "size"}).json()["verdict"] == "quarantined"
    team.upload(data)
    assert team.http.put(f"/v1/ac/{key}", content=manifest).status_code == 201
    got = team.reader.get(f"/v1/cas/{digest}")
    assert got.status_code == 200 and sha256(got.content) == digest


def test_a_resolution_naming_a_quarantined_blob_becomes_a_miss(team: Team):
    key, digest, _ = team.publish("resolved")
    body = {"job": "j1", "attempt": 0}
    assert team.reader.post(f"/v1/ac/{key}/resolve", json=body).status_code == 200
    _rot(team.server, digest)
    assert team.reader.post(f"/v1/cas/{digest}/report",
                            json={"kind": "digest"}).json()["verdict"] == "quarantined"
    r = team.reader.post(f"/v1/ac/{key}/resolve", json=body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "resolved_miss"


def test_a_report_about_a_good_blob_changes_nothing(trusted: ServerProcess):
    victim, hostile = Team(trusted, "victim"), Team(trusted, "hostile")
    try:
        data = os.urandom(30_000)
        key, digest, _ = victim.publish("victim", data)
        report = {"kind": "digest", "detail": "trust me"}
        # a blob the hostile tenant may not see: 404, as a GET would be
        assert hostile.reader.post(f"/v1/cas/{digest}/report", json=report).status_code == 404
        # the same bytes uploaded by the hostile tenant: it may see them, they verify good
        hostile.upload(data)
        answers = [hostile.reader.post(f"/v1/cas/{digest}/report", json=report)
                   for _ in range(12)]
        codes = [a.status_code for a in answers]
        assert codes[0] == 200 and answers[0].json() == {"verdict": "ok"}
        assert 429 in codes and "retry-after" in answers[codes.index(429)].headers
        assert codes.count(200) <= 6  # the burst of 5 (and a refill at 0.2/s)
        # entry-level load reports: one token cannot withdraw by repeating itself
        for _ in range(3):
            hostile.reader.post(f"/v1/ac/{key}/report", json={"kind": "load"})
        assert victim.reader.get(f"/v1/ac/{key}").status_code == 200
        got = victim.reader.get(f"/v1/cas/{digest}")
        assert got.status_code == 200 and sha256(got.content) == digest
        assert all(q["digest"] != digest for q in
                   victim.reader.get("/v1/quarantine").json()["quarantined"])
        assert f"quarantined blob {digest}" not in trusted.log()
        # the victim's own report of the (still good) blob is judged afresh, and agrees
        assert victim.reader.post(f"/v1/cas/{digest}/report", json=report).json() == {
            "verdict": "ok"}
    finally:
        victim.close()
        hostile.close()


def test_entries_torch_repeatedly_fails_to_load_are_withdrawn(team: Team):
    key, _, manifest = team.publish("unloadable")
    report = {"kind": "load", "detail": "RuntimeError: bad pickle"}
    first = team.reader.post(f"/v1/ac/{key}/report", json={**report, "job": "a"})
    assert first.json() == {"verdict": "counted", "reports": 1, "needed": 3}
    # the same token and job again is not independent
    again = team.reader.post(f"/v1/ac/{key}/report", json={**report, "job": "a"})
    assert again.json()["reports"] == 1
    assert team.reader.get(f"/v1/ac/{key}").status_code == 200
    assert team.reader.post(f"/v1/ac/{key}/report",
                            json={**report, "job": "b"}).json()["reports"] == 2
    last = team.http.post(f"/v1/ac/{key}/report", json=report)
    assert last.json() == {"verdict": "withdrawn", "reports": 3, "needed": 3}
    assert team.reader.get(f"/v1/ac/{key}").status_code == 404
    records = team.reader.get("/v1/quarantine").json()["quarantined"]
    assert records[0]["reason"] == "load" and records[0]["withdrawn"] == [
        f"{team.namespace}/{key}"]
    assert team.http.put(f"/v1/ac/{key}", content=manifest,
                         headers={"if-none-match": "*"}).status_code == 201
    # another tenant cannot even count: the entry does not exist for it
    other = Team(team.server, f"o-{os.urandom(3).hex()}")
    try:
        assert other.reader.post(f"/v1/ac/{key}/report", json=report).status_code == 404
    finally:
        other.close()


@pytest.mark.parametrize("body", [
    {"kind": "rumour"}, {"kind": "digest", "detail": "x" * 501}, {"kind": "digest", "x": 1},
    {"kind": "digest", "entry_key": "../etc"}])
def test_malformed_reports_are_refused(team: Team, body: dict[str, object]):
    _, digest, _ = team.publish(f"m{os.urandom(2).hex()}")
    assert team.reader.post(f"/v1/cas/{digest}/report", json=body).status_code == 422


# -- the scrub ---------------------------------------------------------------------------
SCRUB_RATE = 512 * 1024


@pytest.fixture(scope="module", params=BACKENDS)
def scrubbing(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ServerProcess]:
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("scrub") / "data", *args,
        env={**env, "MEGACACHE_SCRUB_BYTES_PER_S": str(SCRUB_RATE),
             "MEGACACHE_SCRUB_INTERVAL_S": "0"}), request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def test_the_scrub_finds_rot_with_no_client_within_its_budget(scrubbing: ServerProcess):
    http = httpx.Client(base_url=scrubbing.url, timeout=30)
    blobs = [os.urandom(200_000) for _ in range(4)]
    keys = []
    for i, data in enumerate(blobs):
        assert http.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        m = make_manifest({"megacache": data}, make_fingerprint(code=f"s{i}"))
        assert http.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
        keys.append(m.key)
    bad = sha256(blobs[2])
    _rot(scrubbing, bad)
    # one whole pass over the store at the budget, plus a second's slack per blob and
    # the scrub's idle wait
    budget_s = sum(map(len, blobs)) / SCRUB_RATE + len(blobs) + 10
    deadline = time.monotonic() + budget_s
    while http.get(f"/v1/ac/{keys[2]}").status_code == 200:
        assert time.monotonic() < deadline, scrubbing.log()[-3000:]
        time.sleep(0.2)
    assert [http.get(f"/v1/ac/{k}").status_code for k in keys] == [200, 200, 404, 200]
    metrics = http.get("/metrics").text
    assert _metric(metrics, "megacache_quarantined_blobs_total")[(("reason", "digest"),)] == 1
    assert _metric(metrics, "megacache_scrub_bytes_total")[()] >= len(blobs[2])
    assert _metric(metrics, "megacache_scrub_blobs_verified_total")[
        (("result", "failed"),)] == 1
    assert f"quarantined blob {bad} (reason digest" in scrubbing.log()
    assert "found by scrub" in scrubbing.log()
    http.close()


# -- provenance ----------------------------------------------------------------------------
PRODUCER = {"x-megacache-client-version": "0.4.1+cpu", "x-megacache-job": "train-42",
            "x-megacache-attempt": "2"}


def _provenance(r: httpx.Response) -> dict[str, object]:
    return json.loads(r.headers["x-megacache-provenance"])


def test_every_entry_records_who_wrote_it(team: Team):
    data = os.urandom(20_000)
    team.upload(data)
    m = make_manifest({"megacache": data}, make_fingerprint(code="prov",
                                                            namespace=team.namespace))
    assert team.http.put(f"/v1/ac/{m.key}", content=m.to_json(),
                         headers=PRODUCER).status_code == 201
    got = team.reader.get(f"/v1/ac/{m.key}")
    first = _provenance(got)
    assert first["writer"] == f"ci-{team.namespace}" and first["writer_id"]
    assert first["writer_scopes"] == ["read", "write"]
    assert first["namespace"] == team.namespace
    assert (first["client_version"], first["job"], first["attempt"]) == ("0.4.1+cpu",
                                                                         "train-42", 2)
    assert first["replaced"] is False
    assert got.headers["x-megacache-writer"] == f"ci-{team.namespace}"
    assert got.headers["x-megacache-writer-scopes"] == "read,write"
    # a rewrite says it replaced an earlier version, and what it (did not) claim
    assert team.http.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 200
    second = _provenance(team.reader.get(f"/v1/ac/{m.key}"))
    assert second["replaced"] is True and second["job"] is None
    assert second["written_at"] >= first["written_at"]  # type: ignore[operator]
    assert second["sequence"] > first["sequence"]  # type: ignore[operator]
    # and the resolve answer carries the provenance of the version resolved, pinned to the
    # job attempt it was resolved for
    r = team.reader.post(f"/v1/ac/{m.key}/resolve", json={"job": "reader", "attempt": 0})
    assert r.status_code == 200
    assert _provenance(r) == {**second, "resolved_for": {"job": "reader", "attempt": 0}}


@pytest.mark.parametrize("header,value", [
    ("x-megacache-job", "../../etc"), ("x-megacache-job", "a" * 129),
    ("x-megacache-job", "-starts-with-dash"), ("x-megacache-attempt", "-1"),
    ("x-megacache-attempt", "1e3"), ("x-megacache-attempt", "01"),
    ("x-megacache-attempt", "99999999"), ("x-megacache-client-version", "x" * 65),
    ("x-megacache-client-version", "1.0 <script>")])
def test_hostile_producer_headers_are_refused(team: Team, header: str, value: str):
    data = os.urandom(1000)
    team.upload(data)
    m = make_manifest({"megacache": data}, make_fingerprint(code=f"h{os.urandom(2).hex()}",
                                                            namespace=team.namespace))
    r = team.http.put(f"/v1/ac/{m.key}", content=m.to_json(), headers={header: value})
    assert r.status_code == 422, r.text
    assert value not in r.text or len(value) < 20
    assert team.reader.get(f"/v1/ac/{m.key}").status_code == 404



# -- a consumer chooses whose bundles it runs ---------------------------------------------

def _lookup(server: ServerProcess, token: str, namespace: str, fp: Fingerprint,
            writers: str) -> tuple[ClientConfig, LoadResult]:
    config = ClientConfig(url=server.url, token=token, namespace=namespace,
                          trusted_writers=writers, ship_kernels=False,
                          ship_toolchain=False).validated()
    result = LoadResult()
    with RemoteCache(config) as remote:
        found = find_entry(remote, fp, result, fallback=True)
    result.served = found
    return config, result


def test_trusted_writers_decide_what_a_consumer_runs_and_who_replaces_it(
        team: Team, tmp_path: Path):
    server, ns = team.server, team.namespace
    trainer = server.token("read,write", namespace=ns, name=f"trainer-w-{ns}")
    ci = server.token("read,write", namespace=ns, name=f"ci-main-{ns}")
    fp = make_fingerprint(code="writers", namespace=ns)
    data = os.urandom(20_000)
    m = make_manifest({"megacache": data}, fp)
    with httpx.Client(base_url=server.url, headers=_bearer(trainer), timeout=30) as h:
        assert h.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        assert h.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201

    _, refused = _lookup(server, trainer, ns, fp, "ci-*")
    assert refused.outcome == "miss" and refused.entry is None, refused
    assert refused.reason.startswith("untrusted writer: ") and f"trainer-w-{ns}" in refused.reason
    assert refused.untrusted_etag
    for anyone in ("", "scope:write", f"trainer-w-{ns}"):
        assert _lookup(server, trainer, ns, fp, anyone)[1].outcome == "hit", anyone
    # nor is it a fallback for a neighbouring key of the same model: the server, given the
    # policy, no longer even offers it (it used to be listed, then refused by the client)
    _, neighbour = _lookup(server, trainer, ns, make_fingerprint(code="next", namespace=ns),
                           "ci-*")
    assert neighbour.outcome == "miss" and neighbour.entry is None, neighbour
    assert neighbour.reason == "no entry for model 'mlp' yet", neighbour.reason
    assert not neighbour.untrusted_etag  # that key is free: its own publish may go ahead

    def publish(token: str) -> Track:
        config, result = _lookup(server, token, ns, fp, "ci-*")
        track = Track(fp, result)
        snap = Snapshot(raw=os.urandom(2_000), counts={}, kernels={}, compile_s=1.0,
                        tracks=[track])
        upload(snap, config, NodeCache(tmp_path / "node", 30), track, "holder-1")
        return track

    untrusted = publish(trainer)  # refused it, is not trusted: leaves it alone
    assert not untrusted.publish.published
    assert "not a trusted writer" in untrusted.publish.reason, untrusted.publish
    assert _provenance(team.reader.get(f"/v1/ac/{m.key}"))["writer"] == f"trainer-w-{ns}"
    trusted = publish(ci)  # refused it, is trusted: replaces that very version
    assert trusted.publish.published, trusted.publish
    after = _lookup(server, trainer, ns, fp, "ci-*")[1]
    assert after.outcome == "hit" and after.entry is not None
    assert after.entry.blob("megacache") != m.blob("megacache")
    provenance = _provenance(team.reader.get(f"/v1/ac/{m.key}"))
    assert provenance["writer"] == f"ci-main-{ns}" and provenance["replaced"] is True


def test_a_consumer_that_trusts_some_writers_falls_back_to_their_newest_entry(team: Team):
    server, ns = team.server, team.namespace
    tokens = {name: server.token("read,write", namespace=ns, name=f"{name}-{ns}")
              for name in ("ci-main", "trainer")}
    written = {}
    for name in ("ci-main", "trainer"):  # the trusted entry first, an untrusted one after
        data = os.urandom(5_000)
        m = make_manifest({"megacache": data}, make_fingerprint(code=f"by-{name}",
                                                                namespace=ns))
        with httpx.Client(base_url=server.url, headers=_bearer(tokens[name]), timeout=30) as h:
            assert h.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
            assert h.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
        written[name] = m.key
    listed = team.reader.get("/v1/ac", params={"model": "mlp", "writers": "ci-*"})
    assert [e["key"] for e in listed.json()["entries"]] == [written["ci-main"]], listed.text
    assert [e["key"] for e in team.reader.get("/v1/ac", params={
        "model": "mlp", "writers": f"trainer-{ns},scope:admin"}).json()["entries"]] == \
        [written["trainer"]]
    # the client's own lookup (listing with its policy) falls back to the trusted entry
    wanted = make_fingerprint(code="not-yet", namespace=ns)
    _, found = _lookup(server, team.reader.headers["authorization"][7:], ns, wanted, "ci-*")
    assert found.outcome == "fallback" and found.entry is not None, found
    assert found.entry.key == written["ci-main"]
    # and so does a job attempt's resolution, chosen once on the server
    fp = wanted
    rule = {"namespace": ns, "model": "mlp", "env": component_digest(fp.env),
            "hw": component_digest(fp.hw)}
    for bad in ("ci main", "scope:", "x" * 200, "a,*b"):
        assert team.reader.get("/v1/ac", params={"writers": bad}).status_code == 422, bad
        r = team.reader.post(f"/v1/ac/{fp.key()}/resolve",
                             json={"job": "policy", "fallback": {**rule, "writers": bad}})
        assert r.status_code == 422 and r.json()["error"]["code"] in (
            "invalid_writers", "invalid_request"), r.text
    r = team.reader.post(f"/v1/ac/{fp.key()}/resolve",
                         json={"job": "policy", "fallback": {**rule, "writers": "ci-*"}})
    assert r.status_code == 200 and r.json()["key"] == written["ci-main"], r.text
    r = team.reader.post(f"/v1/ac/{fp.key()}/resolve",
                         json={"job": "anyone", "fallback": rule})
    assert r.json()["key"] == written["trainer"]  # no policy: the newest, whoever wrote it
    # the client's job resolution sends its policy in the rule
    config = ClientConfig(url=server.url, token=team.reader.headers["authorization"][7:],
                          namespace=ns, trusted_writers="ci-*").validated()
    result = LoadResult()
    with RemoteCache(config) as remote:
        got = find_entry(remote, wanted, result, True, job=JobIdentity(job_id="client-job"))
    assert result.outcome == "fallback" and got is not None, result
    assert got.key == written["ci-main"]


def test_whoami_says_who_the_caller_is(team: Team):
    me = team.reader.get("/v1/whoami")
    assert me.status_code == 200
    assert me.json() == {"name": f"trainer-{team.namespace}", "scopes": ["read"],
                         "namespace": team.namespace}
    assert httpx.get(f"{team.server.url}/v1/whoami", timeout=30).status_code == 401

# -- the bit-rot sequence with real clients ----------------------------------------------

@pytest.fixture(scope="module", params=["sqlite+fs"])
def rotting(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    """A server as trainers use it (no auth, default report limits), on the default storage
    only: what each backend does with a report, a quarantine and a republish is held on
    every backend above (`team`, `scrubbing`); this is the sequence through real trainers."""
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(tmp_path_factory.mktemp("rot") / "data", *args,
                                     env=env), request.param, args).start()
    yield proc
    proc.stop()


@pytest.mark.e2e
def test_rot_costs_one_process_a_cold_compile_and_the_next_machine_starts_warm(
        rotting: ServerProcess, tmp_path_factory: pytest.TempPathFactory, toolchain: Path):
    """Every stored blob rots. The first new machine warns once, compiles cold and reports
    the rot; the server quarantines it and the machine's republish replaces the entry; the
    next new machine starts warm from it. No fsck, no operator."""
    need("torch", "the sequence loads real bundles into torch")
    tmp = tmp_path_factory.mktemp("machines")
    gxx = GxxCounter(tmp / "bin")
    producer = functions_job(Machine(tmp / "producer", toolchain), gxx, rotting.url, "f")
    assert producer.result["published"], producer.result
    stored = rotting.blob_names()
    assert stored
    for digest in stored:
        _rot(rotting, digest)

    first = functions_job(Machine(tmp / "first"), gxx, rotting.url, "f")
    assert first.result["outcome"] == "invalid", first.result
    assert len(first.warnings()) == 1, first.stderr  # one warning, then a cold compile
    assert first.gxx_builds > 0 and first.result["counters"]["fxgraph_miss"] > 0
    assert first.result["reported"] == "quarantined", first.result
    assert first.result["published"], first.result["publish_reason"]  # a clean one replaces it
    assert first.result["results"] == producer.result["results"]

    second = functions_job(Machine(tmp / "second"), gxx, rotting.url, "f")
    assert second.result["outcome"] == "hit", second.result
    assert second.gxx_builds == 0 and second.warnings() == [], second.stderr
    assert second.result["counters"]["fxgraph_miss"] == 0, second.result
    assert second.result["results"] == producer.result["results"]

    records = httpx.get(f"{rotting.url}/v1/quarantine", timeout=30).json()["quarantined"]
    assert {r["digest"] for r in records} & set(stored), records
