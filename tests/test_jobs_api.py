"""Job resolutions and publish claims over HTTP, on real servers (issue items 2 and 3).

Every rank of a job attempt gets the answer its first rank got, on any replica; GC keeps
the blobs of a live resolution; one publisher per key wins a claim; hostile ids and numbers
get a clear 4xx and store nothing.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256

from megacache_client.wire.manifest import Manifest


@pytest.fixture(scope="module", params=BACKENDS)
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ServerProcess]:
    """A shared server with auth; GC (run through the CLI) collects without a grace period."""
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("fleet") / "data", *args, "--auth",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_GC_GRACE_S": "0",
             "MEGACACHE_GC_INTERVAL_S": "0"}), request.param, args).start()
    proc.tokens = {ns: proc.token("read,write,admin", namespace=ns)  # type: ignore[attr-defined]
                   for ns in ("team-a", "team-b")}
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def as_team(proc: ServerProcess, team: str = "team-a") -> httpx.Client:
    return httpx.Client(base_url=proc.url, timeout=30, headers={
        "authorization": f"Bearer {proc.tokens[team]}"})  # type: ignore[attr-defined]


def publish(c: httpx.Client, code: str, data: bytes, *, team: str = "team-a",
            cold: float = 12.5) -> Manifest:
    m = make_manifest({"megacache": data}, make_fingerprint(code=code, namespace=team),
                      cold_compile_s=cold)
    assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code in (200, 201)
    r = c.put(f"/v1/ac/{m.key}", content=m.to_json())
    assert r.status_code in (200, 201), r.text
    return m


def resolve(c: httpx.Client, key: str, job: str, attempt: int = 0, **extra: object
            ) -> httpx.Response:
    return c.post(f"/v1/ac/{key}/resolve", json={"job": job, "attempt": attempt, **extra})


def job_records(proc: ServerProcess) -> int:
    """Resolutions and claims the index holds, read behind the server's back."""
    if "--index" in proc.extra_args:
        import redis

        url = proc.extra_args[proc.extra_args.index("--index") + 1]
        prefix = proc.env["MEGACACHE_REDIS_PREFIX"]
        r = redis.Redis.from_url(url)
        try:
            return len(r.keys(f"{prefix}job:*")) + len(r.keys(f"{prefix}claim:*"))
        finally:
            r.close()
    with sqlite3.connect(proc.data_dir / "index.sqlite3") as db:
        return int(db.execute("SELECT (SELECT COUNT(*) FROM resolutions) + "
                              "(SELECT COUNT(*) FROM claims)").fetchone()[0])


def test_every_rank_of_an_attempt_gets_the_first_answer(fleet: ServerProcess):
    with as_team(fleet) as c:
        v1 = publish(c, "ranks", os.urandom(2048), cold=1.0)
        first = resolve(c, v1.key, "job-ranks")
        assert first.status_code == 200, first.text
        assert first.json()["cold_compile_s"] == 1.0
        assert first.headers["x-megacache-resolution"] == "hit" and first.headers["etag"]
        v2 = publish(c, "ranks", os.urandom(2048), cold=2.0)  # published since: same key

        def rank(_: int) -> tuple[int, bytes]:
            with as_team(fleet) as own:
                r = resolve(own, v1.key, "job-ranks")
                return r.status_code, r.content

        with ThreadPoolExecutor(8) as pool:
            answers = set(pool.map(rank, range(8)))
        assert answers == {(200, first.content)}
        # a restart is a new attempt: it finds what was published meanwhile
        retry = resolve(c, v2.key, "job-ranks", attempt=1)
        assert retry.status_code == 200 and retry.json()["cold_compile_s"] == 2.0


def test_a_miss_stays_a_miss_for_the_attempt(fleet: ServerProcess):
    with as_team(fleet) as c:
        key = make_fingerprint(code="late", namespace="team-a").key()
        miss = resolve(c, key, "job-late")
        assert miss.status_code == 404 and miss.headers["x-megacache-resolution"] == "miss"
        assert miss.json()["error"]["code"] == "resolved_miss"
        publish(c, "late", os.urandom(1024))
        again = resolve(c, key, "job-late")
        assert again.status_code == 404 and again.json()["error"]["code"] == "resolved_miss"
        assert again.json()["error"]["resolved_at"] == miss.json()["error"]["resolved_at"]
        assert resolve(c, key, "job-late", attempt=1).status_code == 200


def test_a_tenant_neither_reads_nor_fixes_another_tenants_job(fleet: ServerProcess):
    with as_team(fleet, "team-a") as a, as_team(fleet, "team-b") as b:
        ma = publish(a, "private", os.urandom(1024))
        # B asks first under A's job name: B's own record, a miss (A's entry is not B's)
        rb = resolve(b, ma.key, "job-shared-name")
        assert rb.status_code == 404 and rb.json()["error"]["code"] == "resolved_miss"
        ra = resolve(a, ma.key, "job-shared-name")
        assert ra.status_code == 200 and ra.json()["key"] == ma.key
        assert resolve(b, ma.key, "job-shared-name").status_code == 404
        # claims are per namespace too: B's claim does not stop A's publisher
        assert b.post(f"/v1/ac/{ma.key}/claim", json={"holder": "b-node"}).status_code == 200
        assert a.post(f"/v1/ac/{ma.key}/claim", json={"holder": "a-node"}).status_code == 200
        assert b.delete(f"/v1/ac/{ma.key}/claim",
                        params={"holder": "b-node"}).status_code == 204
        assert a.delete(f"/v1/ac/{ma.key}/claim",
                        params={"holder": "a-node"}).status_code == 204


def test_one_publisher_per_key(fleet: ServerProcess):
    key = make_fingerprint(code="claimed", namespace="team-a").key()

    def claim(i: int) -> httpx.Response:
        with as_team(fleet) as c:
            return c.post(f"/v1/ac/{key}/claim", json={"holder": f"node-{i}", "lease_s": 60})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(claim, range(8)))
    granted = [r for r in answers if r.status_code == 200]
    assert len(granted) == 1, [r.text for r in answers]
    winner = granted[0].json()["holder"]
    assert granted[0].json()["granted"] is True
    for r in answers:
        if r.status_code != 200:
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["holder"]) == (409, "claim_held", winner)
            assert 0 < err["remaining_s"] <= 60 and winner in err["message"]
    with as_team(fleet) as c:
        # claims are advisory for uploads: another node may still add its new graphs
        publish(c, "claimed", os.urandom(1024))
        refused = c.delete(f"/v1/ac/{key}/claim", params={"holder": "node-x"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "claim_not_held"
        assert c.delete(f"/v1/ac/{key}/claim", params={"holder": winner}).status_code == 204
        assert c.post(f"/v1/ac/{key}/claim", json={"holder": "node-x"}).status_code == 200
        c.delete(f"/v1/ac/{key}/claim", params={"holder": "node-x"})


def test_gc_keeps_the_blobs_of_a_live_resolution(fleet: ServerProcess):
    with as_team(fleet) as c:
        old, new, stray = os.urandom(3000), os.urandom(3000), os.urandom(3000)
        v1 = publish(c, "gc-held", old)
        # the hold must outlive a `gc` run (a new process): three times what one takes on
        # this machine now, however loaded it is
        t = time.monotonic()
        fleet.cli("gc")
        ttl_s = 3 * (time.monotonic() - t) + 1
        assert resolve(c, v1.key, "job-gc", ttl_s=ttl_s).status_code == 200
        publish(c, "gc-held", new)  # replaces v1: `old` is named by no entry now
        c.put(f"/v1/cas/{sha256(stray)}", content=stray)  # named by nothing, held by nothing
        out = fleet.cli("gc")
        assert "unreferenced blob(s) kept: a live job resolution names them" in out, out
        stored = fleet.blob_names()
        assert sha256(old) in stored and sha256(stray) not in stored
        # every rank of the job still downloads what it was given
        r = resolve(c, v1.key, "job-gc", ttl_s=ttl_s)
        assert r.status_code == 200 and r.json()["blobs"][0]["digest"] == sha256(old)
        assert c.get(f"/v1/cas/{sha256(old)}").content == old
        # the job is gone: no rank asked for longer than its resolution lives
        time.sleep(max(0.0, float(r.headers["x-megacache-expires-at"]) - time.time()) + 0.3)
        fleet.cli("gc")
        assert sha256(old) not in fleet.blob_names()
        assert sha256(new) in fleet.blob_names()


HOSTILE_BODIES = [
    b'{"job": "../../etc/passwd", "attempt": 0}',
    b'{"job": "a/b", "attempt": 0}',
    b'{"job": "..", "attempt": 0}',
    b'{"job": "", "attempt": 0}',
    b'{"job": "a\\u0000b", "attempt": 0}',
    b'{"job": "a:b", "attempt": 0}',
    b'{"job": "' + b"x" * 129 + b'", "attempt": 0}',
    b'{"job": "ok", "attempt": -1}',
    b'{"job": "ok", "attempt": 10000001}',
    b'{"job": "ok", "attempt": "0"}',
    b'{"job": "ok", "attempt": true}',
    b'{"job": "ok", "attempt": 0, "ttl_s": NaN}',
    b'{"job": "ok", "attempt": 0, "ttl_s": Infinity}',
    b'{"job": "ok", "attempt": 0, "ttl_s": 1e999}',
    b'{"job": "ok", "attempt": 0, "ttl_s": 1e12}',
    b'{"job": "ok", "attempt": 0, "ttl_s": 0}',
    b'{"job": "ok", "attempt": 0, "ttl_s": -5}',
    b'{"job": "ok", "attempt": 0, "extra": 1}',
    b'{"job": 7}',
    b'not json',
    b'',
]


def test_hostile_input_gets_a_clear_4xx_and_stores_nothing(fleet: ServerProcess):
    key = make_fingerprint(code="hostile", namespace="team-a").key()
    before = job_records(fleet)
    with as_team(fleet) as c:
        for body in HOSTILE_BODIES:
            r = c.post(f"/v1/ac/{key}/resolve", content=body,
                       headers={"content-type": "application/json"})
            assert r.status_code == 422, (body, r.status_code, r.text)
            assert r.json()["error"]["code"] in ("invalid_request", "invalid_job",
                                                 "invalid_attempt", "invalid_ttl"), body
            assert len(r.text) < 4096  # a huge value is never echoed back whole
        big = c.post(f"/v1/ac/{key}/resolve", content=b'{"job": "' + b"x" * 10**6 + b'"}')
        assert big.status_code == 413
        for holder_body in (b'{"holder": "../x"}', b'{"holder": "h", "lease_s": 1e9}',
                            b'{"holder": "h", "lease_s": NaN}', b'{"holder": ""}'):
            r = c.post(f"/v1/ac/{key}/claim", content=holder_body)
            assert r.status_code == 422, (holder_body, r.text)
        assert c.delete(f"/v1/ac/{key}/claim", params={"holder": "../x"}).status_code == 422
        assert c.post("/v1/ac/..%2F..%2Fetc/resolve", json={"job": "ok"}).status_code in (
            400, 404)
        # a reader may resolve but not claim; no token: nothing
    assert httpx.post(f"{fleet.url}/v1/ac/{key}/resolve",
                      json={"job": "ok"}).status_code == 401
    reader = fleet.token("read", namespace="team-a")
    assert httpx.post(f"{fleet.url}/v1/ac/{key}/claim", json={"holder": "h"},
                      headers={"authorization": f"Bearer {reader}"}).status_code == 403
    assert job_records(fleet) == before


# -- replicas sharing one Redis ----------------------------------------------------------
@pytest.fixture
def replicas(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[list[ServerProcess]]:
    args, env = backend_args("redis+s3", request)
    procs = [_configured(ServerProcess(tmp_path_factory.mktemp(f"jobs-replica{i}") / "data",
                                       *args, env=env), "redis+s3", args).start()
             for i in range(2)]
    yield procs
    for p in procs:
        p.stop()


def test_replicas_give_every_rank_the_same_resolution(replicas: list[ServerProcess]):
    data = os.urandom(4096)
    fp = make_fingerprint(code="replicated-job")
    with httpx.Client(base_url=replicas[0].url, timeout=30) as c:
        c.put(f"/v1/cas/{sha256(data)}", content=data)

    def rank(i: int) -> tuple[int, bytes]:
        if i == 5:  # published mid-start, through one replica: the ranks still agree
            m = make_manifest({"megacache": data}, fp)
            with httpx.Client(base_url=replicas[0].url, timeout=30) as c:
                assert c.put(f"/v1/ac/{fp.key()}", content=m.to_json()).status_code == 201
        with httpx.Client(base_url=replicas[i % 2].url, timeout=30) as c:
            r = c.post(f"/v1/ac/{fp.key()}/resolve", json={"job": "job-rep", "attempt": 0})
            return r.status_code, r.content if r.status_code == 200 else b""

    with ThreadPoolExecutor(12) as pool:
        answers = set(pool.map(rank, range(12)))
    assert len(answers) == 1, answers
    for replica in replicas:  # the attempt's answer holds, whatever was published since
        with httpx.Client(base_url=replica.url, timeout=30) as c:
            r = c.post(f"/v1/ac/{fp.key()}/resolve", json={"job": "job-rep", "attempt": 0})
            assert {(r.status_code, r.content if r.status_code == 200 else b"")} == answers
            assert c.post(f"/v1/ac/{fp.key()}/resolve",
                          json={"job": "job-rep", "attempt": 1}).status_code == 200

    def claim(i: int) -> int:
        with httpx.Client(base_url=replicas[i % 2].url, timeout=30) as c:
            return c.post(f"/v1/ac/{fp.key()}/claim",
                          json={"holder": f"node-{i}", "lease_s": 60}).status_code

    with ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(claim, range(8))) == [200] + [409] * 7


def test_the_fallback_is_chosen_once_per_attempt(fleet: ServerProcess):
    """A key without an entry resolves to the model's newest compatible entry, chosen by the
    first rank: an entry for the exact key published meanwhile changes nothing for the
    attempt's other ranks (they would have listed entries at their own moments)."""
    from megacache_client.wire.manifest import component_digest

    with as_team(fleet) as c:
        older = publish(c, "fallback-v1", os.urandom(1024))
        fp = make_fingerprint(code="fallback-v2", namespace="team-a")
        rule = {"namespace": fp.namespace, "model": fp.model,
                "env": component_digest(fp.env), "hw": component_digest(fp.hw)}
        first = resolve(c, fp.key(), "job-fb", fallback=rule)
        assert first.status_code == 200, first.text
        assert Manifest.from_json(first.content).key == older.key  # the stand-in
        exact = publish(c, "fallback-v2", os.urandom(1024))
        assert exact.key == fp.key()
        later = resolve(c, fp.key(), "job-fb", fallback=rule)
        assert later.content == first.content
        assert Manifest.from_json(resolve(c, fp.key(), "job-fb", attempt=1,
                                          fallback=rule).content).key == exact.key
        # a rule naming another namespace is refused, not answered from it
        missing = make_fingerprint(code="fallback-v3", namespace="team-a").key()
        other = resolve(c, missing, "job-fb-x", fallback={**rule, "namespace": "team-b"})
        assert other.status_code == 403, other.text
        bad = resolve(c, fp.key(), "job-fb-y", fallback={**rule, "env": "../x"})
        assert bad.status_code == 422
