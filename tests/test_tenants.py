"""A hostile tenant against a shared server, on every backend pair.

Team A holds a write token of its own namespace and tries every way into another tenant's
data, time or room; team B is well behaved. After each attack B's entries, blobs, stats,
dashboard, GC and fsck are checked to be as they were.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256, uploads_at_once
from prometheus_client.parser import text_string_to_metric_families

MiB = 1024 * 1024


@pytest.fixture(scope="module", params=BACKENDS)
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("shared") / "data", *args, "--auth", "--store-budget", "20MiB",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_NAMESPACE_PENDING_BYTES": "4MiB",
             "MEGACACHE_NAMESPACE_QUOTA_ENTRIES": "3", "MEGACACHE_EVENT_RATE": "2",
             "MEGACACHE_EVENT_BURST": "10", "MEGACACHE_METRICS_MODELS_PER_NAMESPACE": "2"}),
        request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class Team:
    """A tenant: its own token and namespace, and what it has stored."""

    def __init__(self, server: ServerProcess, namespace: str, scopes: str = "read,write"):
        self.server = server
        self.namespace = namespace
        self.headers = bearer(server.token(scopes, namespace=namespace, name=namespace))
        self.http = httpx.Client(base_url=server.url, headers=self.headers, timeout=30)

    def publish(self, code: str, size: int = 100_000, model: str = "mlp") -> str:
        data = os.urandom(size)
        assert self.http.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        m = make_manifest({"megacache": data}, make_fingerprint(
            model=model, code=code, namespace=self.namespace))
        r = self.http.put(f"/v1/ac/{m.key}", content=m.to_json())
        assert r.status_code == 201, r.text
        return m.key

    def event(self, **fields: object) -> httpx.Response:
        body = {"key": "b" * 64, "model": "mlp", "outcome": "hit", "compile_s": 1.0,
                "cold_compile_s": 30.0, "saved_s": 29.0, **fields}
        return self.http.post("/v1/events", json=body)

    def _blob_state(self, digest: str) -> tuple[int, int, bool]:
        """HEAD (the index's record) and GET (the store's bytes, hashed)."""
        got = self.http.get(f"/v1/cas/{digest}")
        return (self.http.head(f"/v1/cas/{digest}").status_code, got.status_code,
                sha256(got.content) == digest)

    def snapshot(self) -> dict[str, object]:
        """Everything of this team another team must never change."""
        entries = self.http.get("/v1/ac", params={"limit": 1000}).json()["entries"]
        stats = self.http.get("/v1/stats")
        dashboard = self.http.get("/v1/dashboard")
        assert stats.status_code == 200 and dashboard.status_code == 200
        blobs = {b["digest"]: self._blob_state(b["digest"]) for e in entries for b in e["blobs"]}
        return {"entries": sorted(e["key"] for e in entries), "blobs": blobs,
                "stats": stats.json(), "models": dashboard.json()["models"],
                "store": dashboard.json()["store"]}


@pytest.fixture
def teams(shared: ServerProcess) -> Iterator[tuple[Team, Team]]:
    n = os.urandom(3).hex()
    a, b = Team(shared, f"a-{n}"), Team(shared, f"b-{n}")
    b.publish("b-entry", model="b-model")
    assert b.event(model="b-model").status_code == 202
    yield a, b
    a.http.close()
    b.http.close()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_refused(teams: tuple[Team, Team], value: str):
    a, b = teams
    before = b.snapshot()
    data = os.urandom(1000)
    assert a.http.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
    m = make_manifest({"megacache": data}, make_fingerprint(code="nan", namespace=a.namespace,
                                                            env={"torch": 1.5}))
    body = m.to_json().replace(b'"torch":1.5', f'"torch":{value}'.encode())
    assert value.encode() in body
    r = a.http.put(f"/v1/ac/{m.key}", content=body)
    assert r.status_code == 422, r.text
    assert a.http.get(f"/v1/ac/{m.key}").status_code == 404
    assert a.http.get("/v1/dashboard").status_code == 200
    assert b.snapshot() == before


def test_the_server_stores_exactly_the_bytes_it_validated(teams: tuple[Team, Team]):
    a, _ = teams
    data = os.urandom(1000)
    a.http.put(f"/v1/cas/{sha256(data)}", content=data)
    m = make_manifest({"megacache": data}, make_fingerprint(code="exact", namespace=a.namespace))
    body = json.dumps(json.loads(m.to_json()), indent=1).encode()  # same JSON, other bytes
    assert a.http.put(f"/v1/ac/{m.key}", content=body).status_code == 201
    assert a.http.get(f"/v1/ac/{m.key}").content == body


def _damage(server: ServerProcess, key: str) -> None:
    """What a bug or a disk error could leave: a stored manifest that no longer parses."""
    if server.backend.startswith("redis"):
        import redis

        url = server.extra_args[server.extra_args.index("--index") + 1]
        r = redis.Redis.from_url(url)
        r.hset(server.env["MEGACACHE_REDIS_PREFIX"] + f"entry:{key}", "manifest", b'{"x": null')
        return
    with sqlite3.connect(server.data_dir / "index.sqlite3") as db:
        db.execute("UPDATE entries SET manifest=? WHERE key=?", (b'{"x": null', key))


def test_a_damaged_record_stops_nothing_and_fsck_removes_it(teams: tuple[Team, Team]):
    a, b = teams
    key = a.publish("doomed")
    _damage(a.server, key)
    before = b.snapshot()
    assert a.http.get("/v1/ac").status_code == 200
    assert a.http.get("/v1/dashboard").status_code == 200
    assert "evicted" in a.server.cli("gc")
    report = a.server.cli("fsck", "--verify", "--repair")
    assert f"unreadable entry {key}" in report and "repaired" in report
    assert a.http.get(f"/v1/ac/{key}").status_code == 404
    assert b.snapshot() == before


def test_event_numbers_are_bounded_and_sums_cannot_overflow(teams: tuple[Team, Team]):
    a, b = teams
    before = b.snapshot()
    assert a.event(bytes_down=2**53).status_code == 422
    assert a.event(saved_s=1e9, cold_compile_s=1e9).status_code == 422  # more than a week
    assert a.event(saved_s=50.0, cold_compile_s=30.0).status_code == 422  # saves > it cost
    nan = b'{"key": "' + b"b" * 64 + b'", "model": "m", "outcome": "miss", "compile_s": NaN}'
    assert a.http.post("/v1/events", content=nan).status_code == 422
    for _ in range(5):  # within the burst of 10, rejected events included
        assert a.event(bytes_down=2**40, model="big").status_code == 202
    stats = a.http.get("/v1/stats").json()
    assert stats["total"]["bytes_down"] == 5 * 2**40
    for path in ("/v1/stats", "/v1/dashboard", "/metrics"):
        assert a.http.get(path).status_code == 200
    assert b.snapshot() == before


def test_namespaces_see_only_their_own_numbers(shared: ServerProcess,
                                               teams: tuple[Team, Team]):
    a, b = teams
    secret = f"secret-{a.namespace}"
    a.publish("private", model=secret)
    assert a.event(model=secret, outcome="miss", saved_s=0.0,
                   reason="/home/alice/private/path").status_code == 202
    before_a = a.http.get("/v1/stats").json()
    for path in ("/v1/stats", "/v1/dashboard", "/metrics"):
        text = b.http.get(path).text
        assert secret not in text and "/home/alice" not in text, path
    assert secret in a.http.get("/metrics").text
    # an event naming A's model, posted by B, counts in B's namespace only
    assert b.event(model=secret, saved_s=29.0).status_code == 202
    assert a.http.get("/v1/stats").json() == before_a
    assert httpx.get(f"{shared.url}/metrics").status_code == 401
    scraper = bearer(shared.token("metrics", name="prometheus"))
    scrape = httpx.get(f"{shared.url}/metrics", headers=scraper)
    assert scrape.status_code == 200
    assert {(a.namespace, secret), (b.namespace, "b-model")} <= _run_series(scrape.text)
    assert httpx.get(f"{shared.url}/v1/stats", headers=scraper).status_code == 403


SERVER_WIDE = ("megacache_http_requests_total", "megacache_lookups_total",
               "megacache_blob_upload_bytes_total", "megacache_store_bytes")
"""Series that move with every tenant's requests: the operator's, not a tenant's."""


def _names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_show_a_reader_its_namespace_and_server_figures_only_to_operators(
        shared: ServerProcess, teams: tuple[Team, Team]):
    a, b = teams
    a.publish("metrics-a", model=f"m-{a.namespace}")
    assert a.event(model=f"m-{a.namespace}").status_code == 202
    assert a.http.get("/v1/ac/" + "0" * 64).status_code == 404  # a lookup counted
    reader = b.http.get("/metrics")
    assert reader.status_code == 200
    assert _names(reader.text).isdisjoint(SERVER_WIDE), _names(reader.text) & set(SERVER_WIDE)
    assert a.namespace not in reader.text
    admin = httpx.get(f"{shared.url}/metrics", timeout=30, headers=bearer(
        shared.token("admin", namespace=b.namespace, name=f"admin-{b.namespace}")))
    assert {"megacache_http_requests_total", "megacache_lookups_total"} <= _names(admin.text)
    assert a.namespace not in admin.text  # the server's traffic, B's series only
    scrape = httpx.get(f"{shared.url}/metrics", timeout=30, headers=bearer(
        shared.token("metrics", name="prometheus")))
    assert set(SERVER_WIDE) - _names(scrape.text) == set()
    assert a.namespace in scrape.text


def test_a_tenant_over_its_metrics_budget_shows_two_models_and_other(
        shared: ServerProcess, teams: tuple[Team, Team]):
    """#47 item 5: A posts five model names over a budget of two; the scrape shows A's two
    busiest and one `other` summing the rest, and B's series as they were."""
    a, b = teams
    for i, times in enumerate((3, 2, 1, 1, 1)):  # within the event burst (10); m0 busiest
        for _ in range(times):
            assert a.event(model=f"m{i}").status_code == 202
    scrape = httpx.get(f"{shared.url}/metrics", timeout=30, headers=bearer(
        shared.token("metrics", name=f"prom-{a.namespace}"))).text
    series = _run_series(scrape)
    assert {m for ns, m in series if ns == a.namespace} == {"m0", "m1", "other"}
    assert {m for ns, m in series if ns == b.namespace} == {"b-model"}
    runs = {s.labels["model"]: s.value for f in text_string_to_metric_families(scrape)
            if f.name == "megacache_runs" for s in f.samples
            if s.labels["namespace"] == a.namespace and s.labels["outcome"] == "hit"}
    assert runs == {"m0": 3, "m1": 2, "other": 3}


def _run_series(text: str) -> set[tuple[str, str]]:
    return {(s.labels["namespace"], s.labels["model"])
            for f in text_string_to_metric_families(text) if f.name == "megacache_runs"
            for s in f.samples}


def test_one_tenant_cannot_fill_the_store_for_another(teams: tuple[Team, Team]):
    a, b = teams
    before = b.snapshot()
    # A over its entry quota (3) loses its own oldest entries, never B's
    keys = [a.publish(f"q{i}") for i in range(5)]
    present = [a.http.get(f"/v1/ac/{k}").status_code for k in keys]
    assert present == [404, 404, 200, 200, 200]
    codes = []
    for _ in range(6):  # unreferenced uploads: capped per namespace at 4 MiB
        data = os.urandom(MiB)
        codes.append(a.http.put(f"/v1/cas/{sha256(data)}", content=data).status_code)
    assert codes[:3] == [201] * 3 and codes[-1] == 507, codes
    r = a.http.put(f"/v1/cas/{sha256(b'x' * MiB)}", content=b"x" * MiB)
    assert r.json()["error"]["code"] == "pending_quota"
    assert b.snapshot() == before
    b.publish("b-after", size=MiB)  # B still uploads and writes


def test_event_floods_are_rate_limited_per_token(teams: tuple[Team, Team]):
    a, b = teams
    codes = [a.event().status_code for _ in range(30)]
    assert codes.count(202) <= 14 and 429 in codes, codes
    limited = a.event()
    if limited.status_code == 429:
        assert int(limited.headers["retry-after"]) >= 1
    assert b.event().status_code == 202


def test_concurrent_entry_writes_never_answer_500(teams: tuple[Team, Team]):
    a, _ = teams
    data = os.urandom(2000)
    assert a.http.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
    manifests = [make_manifest({"megacache": data}, make_fingerprint(
        code=f"c{i % 3}", namespace=a.namespace), cold_compile_s=float(i)) for i in range(120)]

    def write(i: int) -> int:
        m = manifests[i]
        if i % 2:
            return a.http.get(f"/v1/ac/{m.key}").status_code
        return a.http.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(write, range(120)))
    assert all(c < 500 for c in codes), codes


def _last_access(server: ServerProcess, key: str) -> float:
    """The entry's LRU time as the backend holds it (what eviction orders by)."""
    if server.backend.startswith("redis"):
        import redis

        url = server.extra_args[server.extra_args.index("--index") + 1]
        value = redis.Redis.from_url(url).hget(
            server.env["MEGACACHE_REDIS_PREFIX"] + f"entry:{key}", "last_access")
        return float(value or 0)
    with sqlite3.connect(server.data_dir / "index.sqlite3") as db:
        return float(db.execute("SELECT last_access FROM entries WHERE key=?",
                                (key,)).fetchone()[0])


def _touched_at(server: ServerProcess, digest: str) -> float:
    """The blob's last touch as the backend holds it (what GC's grace period reads)."""
    if server.backend.startswith("redis"):
        import redis

        url = server.extra_args[server.extra_args.index("--index") + 1]
        return float(redis.Redis.from_url(url).zscore(
            server.env["MEGACACHE_REDIS_PREFIX"] + "blob_touched", digest) or 0)
    with sqlite3.connect(server.data_dir / "index.sqlite3") as db:
        return float(db.execute("SELECT touched_at FROM blobs WHERE digest=?",
                                (digest,)).fetchone()[0])


def test_a_refused_manifest_touches_no_blob(teams: tuple[Team, Team]):
    a, b = teams
    theirs, ours = os.urandom(5_000), os.urandom(6_000)
    assert b.http.put(f"/v1/cas/{sha256(theirs)}", content=theirs).status_code == 201
    assert a.http.put(f"/v1/cas/{sha256(ours)}", content=ours).status_code == 201
    before = {d: _touched_at(a.server, d) for d in (sha256(theirs), sha256(ours))}
    fp = make_fingerprint(code="refused", namespace=a.namespace)
    naming_theirs = make_manifest({"megacache": ours, "kernels": theirs}, fp)
    r = a.http.put(f"/v1/ac/{naming_theirs.key}", content=naming_theirs.to_json())
    assert r.status_code == 424 and r.json()["error"]["missing"] == [sha256(theirs)], r.text
    wrong = json.loads(make_manifest({"megacache": ours}, fp).to_json())
    wrong["blobs"][0]["size"] += 1
    r = a.http.put(f"/v1/ac/{naming_theirs.key}", content=json.dumps(wrong))
    assert r.status_code == 422 and r.json()["error"]["code"] == "size_mismatch", r.text
    assert {d: _touched_at(a.server, d) for d in before} == before
    assert a.http.get(f"/v1/ac/{naming_theirs.key}").status_code == 404
    ok = make_manifest({"megacache": ours}, fp)  # a write that passes touches its blobs
    assert a.http.put(f"/v1/ac/{ok.key}", content=ok.to_json()).status_code == 201
    assert _touched_at(a.server, sha256(ours)) > before[sha256(ours)]


def test_a_lookup_of_another_tenants_key_does_not_reorder_its_eviction(
        teams: tuple[Team, Team]):
    import time

    a, b = teams
    key = a.publish("lru-target")
    own = b.publish("lru-own")
    before, own_before = _last_access(a.server, key), _last_access(a.server, own)
    for _ in range(3):
        assert b.http.get(f"/v1/ac/{key}").status_code == 404
    # SQLite writes buffered access times at a touch a second after its last write: B's own
    # lookups flush whatever its lookups of A's key would have buffered
    deadline = time.monotonic() + 10
    while _last_access(a.server, own) <= own_before and time.monotonic() < deadline:
        time.sleep(0.3)
        assert b.http.get(f"/v1/ac/{own}").status_code == 200
    assert _last_access(a.server, own) > own_before  # access times did reach the store
    assert _last_access(a.server, key) == before


def test_uploads_in_flight_count_against_the_pending_quota(teams: tuple[Team, Team]):
    a, b = teams
    before = b.snapshot()
    size = 1_500_000  # 12 MB at once against a 4 MiB quota
    codes, blobs = uploads_at_once([a.server.url], a.headers, 8, size)
    stored = [d for d in blobs if a.http.head(f"/v1/cas/{sha256(d)}").status_code == 200]
    assert codes.count(201) == len(stored) <= (4 * MiB) // size, codes
    assert 507 in codes, codes
    assert b.snapshot() == before


def test_another_tenants_bytes_pass_the_same_quota_as_new_ones(teams: tuple[Team, Team]):
    a, b = teams
    theirs = os.urandom(MiB)
    assert b.http.put(f"/v1/cas/{sha256(theirs)}", content=theirs).status_code == 201
    for _ in range(4):  # A fills its 4 MiB of unreferenced uploads
        data = os.urandom(MiB)
        a.http.put(f"/v1/cas/{sha256(data)}", content=data)
    fresh = os.urandom(MiB)
    new = a.http.put(f"/v1/cas/{sha256(fresh)}", content=fresh)
    existing = a.http.put(f"/v1/cas/{sha256(theirs)}", content=theirs)
    assert new.status_code == existing.status_code == 507, (new.text, existing.text)
    assert new.json()["error"]["code"] == existing.json()["error"]["code"] == "pending_quota"
    assert a.http.head(f"/v1/cas/{sha256(theirs)}").status_code == 404  # still not A's


def test_a_quarantine_shows_another_tenant_neither_the_reporter_nor_the_detail(
        teams: tuple[Team, Team]):
    a, b = teams
    data = os.urandom(30_000)  # both own these bytes; the store keeps one copy
    for team in (a, b):
        assert team.http.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        m = make_manifest({"megacache": data}, make_fingerprint(
            code="shared-rot", namespace=team.namespace))
        assert team.http.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
    rotten = bytearray(a.server.read_stored(sha256(data)))
    rotten[100] ^= 0xFF
    a.server.write_stored(sha256(data), bytes(rotten))
    said = f"private note of {a.namespace}"
    r = a.http.post(f"/v1/cas/{sha256(data)}/report", json={"kind": "digest", "detail": said})
    assert r.json()["verdict"] == "quarantined", r.text

    def record(team: Team) -> dict[str, object]:
        found = team.http.get("/v1/quarantine").json()["quarantined"]
        return next(q for q in found if q["digest"] == sha256(data))

    ours, theirs = record(a), record(b)
    assert ours["reporter"] == a.namespace and said in str(ours["detail"])
    assert theirs["reason"] == "digest" and theirs["namespaces"] == [b.namespace]
    assert theirs["reporter"] == "another namespace"
    assert theirs["detail"] == "its stored bytes do not match their sha256"
    assert [w.split("/")[0] for w in theirs["withdrawn"]] == [b.namespace]  # type: ignore
    for leak in (a.namespace, said):
        for path in ("/v1/quarantine", "/v1/stats", "/v1/dashboard"):
            assert leak not in b.http.get(path).text, (leak, path)
