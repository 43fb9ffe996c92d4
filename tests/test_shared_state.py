"""What several server processes must agree on: every limit, quota and version number is
held in the shared index, not in one process.

`pair` is two server processes on one storage (the same data dir and SQLite file, or the same
Redis and bucket), requests alternating between them: what two replicas behind a load
balancer see, deterministically. `workers` is one server with `MEGACACHE_WORKERS=2`, whose
connections the kernel spreads over its two processes.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256, uploads_at_once

from megacache_client.wire import headers
from megacache_client.wire.signing import signature_valid
from megacache_server.service.security.signing import write_new_key

MiB = 1024 * 1024
SHARED_ENV = {"MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_NAMESPACE_PENDING_BYTES": "4MiB",
              "MEGACACHE_EVENT_RATE": "0.01", "MEGACACHE_EVENT_BURST": "5",
              "MEGACACHE_JOB_RATE": "0.01", "MEGACACHE_JOB_BURST": "30",
              "MEGACACHE_NAMESPACE_JOB_RECORDS": "20"}
"""Limits small enough to meet in a test; each test's tenants have tokens of their own."""


@pytest.fixture(scope="module")
def public_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("key") / "signing.pem"
    return path, write_new_key(path)


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         public_key: tuple[Path, str]) -> Iterator[list[ServerProcess]]:
    """Two server processes sharing one storage, auth and signing on."""
    args, env = backend_args(request.param, request)
    data = tmp_path_factory.mktemp("pair") / "data"
    env = {**env, **SHARED_ENV, "MEGACACHE_SIGNING_KEY_FILE": str(public_key[0])}
    procs = [_configured(ServerProcess(data, *args, "--auth", env=env), request.param,
                         args).start() for _ in range(2)]
    yield procs
    for proc in procs:
        proc.stop()
    for proc in procs:
        assert "Traceback" not in proc.log(), proc.log()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class Tenant:
    """A namespace's clients of each server of a pair (same token)."""

    def __init__(self, servers: list[ServerProcess], scopes: str = "read,write,admin",
                 namespace: str | None = None) -> None:
        self.namespace = namespace or f"n-{os.urandom(3).hex()}"
        token = servers[0].token(scopes, namespace=self.namespace, name=f"w-{self.namespace}")
        self.via = [httpx.Client(base_url=s.url, headers=bearer(token), timeout=60)
                    for s in servers]

    def close(self) -> None:
        for c in self.via:
            c.close()


@pytest.fixture(scope="module", params=BACKENDS)
def workers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[list[ServerProcess]]:
    """One server of two uvicorn workers, auth on (a list of one, as `pair` is of two)."""
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(tmp_path_factory.mktemp("workers") / "data", *args,
                                     "--auth", env={**env, **SHARED_ENV,
                                                    "MEGACACHE_WORKERS": "2"}),
                       request.param, args).start()
    yield [proc]
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture
def tenant(pair: list[ServerProcess]) -> Iterator[Tenant]:
    t = Tenant(pair)
    yield t
    t.close()


# -- sequence numbers ------------------------------------------------------------------
def _sequence(r: httpx.Response) -> int:
    return int(json.loads(r.headers[headers.PROVENANCE])["sequence"])


def test_every_version_of_a_key_is_numbered_above_the_last_on_every_replica(
        tenant: Tenant, public_key: tuple[Path, str]):
    """Rewrites, a delete and a re-create, alternating replicas: each version's signed
    provenance carries a sequence above every earlier one (the client refuses a lower one
    than it has seen: a proxy replaying a superseded manifest)."""
    data = os.urandom(3000)
    first, second = tenant.via
    assert first.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
    fp = make_fingerprint(code="versions", namespace=tenant.namespace)
    seen = []
    for i, (client, delete) in enumerate([(first, False), (second, False), (first, True),
                                          (second, False), (first, False)]):
        if delete:
            assert client.delete(f"/v1/ac/{fp.key()}").status_code == 204
        m = make_manifest({"megacache": data}, fp, cold_compile_s=float(i + 1))
        put = client.put(f"/v1/ac/{fp.key()}", content=m.to_json())
        assert put.status_code in (200, 201), put.text
        got = tenant.via[i % 2 - 1].get(f"/v1/ac/{fp.key()}")
        assert _sequence(got) == _sequence(put), (got.headers, put.headers)
        assert signature_valid(public_key[1], fp.key(), tenant.namespace, got.content,
                               got.headers[headers.PROVENANCE_SIGNATURE],
                               got.headers[headers.PROVENANCE])
        seen.append(_sequence(got))
    assert seen == sorted(set(seen)), seen


def _drop_provenance(server: ServerProcess, key: str) -> None:
    """An entry as a store from before provenance holds it."""
    if server.backend.startswith("redis"):
        import redis

        url = server.extra_args[server.extra_args.index("--index") + 1]
        redis.Redis.from_url(url).hset(server.env["MEGACACHE_REDIS_PREFIX"] + f"entry:{key}",
                                       "provenance", "")
        return
    with sqlite3.connect(server.data_dir / "index.sqlite3") as db:
        db.execute("UPDATE entries SET provenance='' WHERE key=?", (key,))


def test_an_entry_without_provenance_is_served_a_signed_unknown_writer_of_sequence_0(
        pair: list[ServerProcess], tenant: Tenant, public_key: tuple[Path, str]):
    data = os.urandom(2000)
    client = tenant.via[0]
    assert client.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
    m = make_manifest({"megacache": data}, make_fingerprint(code="legacy",
                                                            namespace=tenant.namespace))
    assert client.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
    _drop_provenance(pair[0], m.key)
    for got in (client.get(f"/v1/ac/{m.key}"),
                client.post(f"/v1/ac/{m.key}/resolve", json={"job": "legacy"})):
        assert got.status_code == 200, got.text
        served = json.loads(got.headers[headers.PROVENANCE])
        assert (served["sequence"], served["writer"], served["writer_scopes"]) == (0, "", [])
        assert served["namespace"] == tenant.namespace
        assert headers.WRITER not in got.headers
        assert signature_valid(public_key[1], m.key, tenant.namespace, got.content,
                               got.headers[headers.PROVENANCE_SIGNATURE],
                               got.headers[headers.PROVENANCE])
    # the next version counts on from what the key had
    again = client.put(f"/v1/ac/{m.key}", content=m.to_json())
    assert _sequence(again) > 0 and json.loads(again.headers[headers.PROVENANCE])["writer"]


# -- the pending quota -----------------------------------------------------------------
def _never_overshoot(servers: list[ServerProcess]) -> None:
    """16 uploads of 1.5 MB at once against a 4 MiB quota, spread over two processes:
    at most two pass, wherever they landed (a quota kept per process let each pass two)."""
    t = Tenant(servers)
    try:
        codes, blobs = uploads_at_once([s.url for s in servers], dict(t.via[0].headers), 16,
                                       1_500_000)
        stored = sum(t.via[0].head(f"/v1/cas/{sha256(d)}").status_code == 200 for d in blobs)
    finally:
        t.close()
    assert codes.count(201) == stored <= (4 * MiB) // 1_500_000, codes
    assert 507 in codes, codes


def test_uploads_in_flight_on_two_replicas_count_against_one_pending_quota(
        pair: list[ServerProcess]):
    _never_overshoot(pair)


def test_uploads_in_flight_on_two_workers_count_against_one_pending_quota(
        workers: list[ServerProcess]):
    _never_overshoot(workers)


def test_bytes_another_tenant_named_count_on_the_pending_quota_like_new_ones(
        pair: list[ServerProcess]):
    """B stores X and names it in an entry. A uploads X, then new bytes: A's quota fills
    after exactly as many uploads as if X were new (before, X did not count for A once
    B's entry named it, which told A that B had stored X)."""
    a, b = Tenant(pair), Tenant(pair)
    try:
        known = os.urandom(MiB)
        assert b.via[0].put(f"/v1/cas/{sha256(known)}", content=known).status_code == 201
        m = make_manifest({"megacache": known}, make_fingerprint(code="known",
                                                                 namespace=b.namespace))
        assert b.via[0].put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
        answers = []
        for data in (known, *(os.urandom(MiB) for _ in range(4))):
            r = a.via[len(answers) % 2].put(f"/v1/cas/{sha256(data)}", content=data)
            answers.append((r.status_code, r.json().get("created"),
                            r.json().get("error", {}).get("pending")))
        assert answers == [(201, True, None)] * 4 + [(507, None, 4 * MiB)], answers
    finally:
        a.close()
        b.close()


# -- rate limits and job records --------------------------------------------------------
def _event(client: httpx.Client) -> int:
    return client.post("/v1/events", json={
        "key": "b" * 64, "model": "mlp", "outcome": "hit", "compile_s": 1.0,
        "cold_compile_s": 30.0, "saved_s": 29.0}).status_code


def test_a_tokens_event_limit_holds_across_replicas(tenant: Tenant):
    """A burst of 5, spread over two processes: 5 pass (a bucket per process let 10)."""
    codes = [_event(tenant.via[i % 2]) for i in range(14)]
    assert codes.count(202) == 5 and codes.count(429) == 9, codes


def test_a_tokens_event_limit_holds_across_workers(workers: list[ServerProcess]):
    t = Tenant(workers)
    try:
        codes = []
        for _ in range(14):  # fresh connections: the kernel spreads them over both workers
            with httpx.Client(base_url=workers[0].url, timeout=30,
                              headers=dict(t.via[0].headers)) as c:
                codes.append(_event(c))
    finally:
        t.close()
    assert codes.count(202) == 5, codes


def test_tokens_of_the_same_name_in_two_namespaces_never_share_a_limit(
        pair: list[ServerProcess]):
    """Limits key on the token, not its name: a tenant cannot drain another's bucket by
    naming its token alike (the event limit was keyed by name)."""
    clients = [httpx.Client(base_url=pair[0].url, timeout=30, headers=bearer(pair[0].token(
        "read,write", namespace=f"same-{i}-{os.urandom(2).hex()}", name="ci")))
               for i in range(2)]
    try:
        drained = [_event(clients[0]) for _ in range(8)]
        assert drained.count(429) == 3, drained
        assert _event(clients[1]) == 202
    finally:
        for c in clients:
            c.close()


def test_job_records_are_capped_per_namespace_and_requests_limited_per_token(
        pair: list[ServerProcess]):
    """A read token making up job ids: 20 records (the namespace's cap), then 507 with a
    message; every resolve counts on its token's limit (a burst of 30), then 429. The
    records it holds still answer as before; another namespace is not affected."""
    reader, other = Tenant(pair, scopes="read"), Tenant(pair, scopes="read")
    key = "c" * 64
    try:
        answers = [reader.via[i % 2].post(f"/v1/ac/{key}/resolve", json={"job": f"j{i}"})
                   for i in range(34)]
        codes = [r.status_code for r in answers]
        assert codes == [404] * 20 + [507] * 10 + [429] * 4, codes
        assert answers[20].json()["error"]["code"] == "job_records_quota"
        assert "20 live job resolutions" in answers[20].json()["error"]["message"]
        assert int(answers[-1].headers["retry-after"]) >= 1
        same = Tenant(pair, scopes="read", namespace=reader.namespace)  # its own bucket
        held = same.via[0].post(f"/v1/ac/{key}/resolve", json={"job": "j3"})
        assert held.json()["error"]["code"] == "resolved_miss"  # a live record answers
        assert same.via[1].post(f"/v1/ac/{key}/resolve",
                                json={"job": "new"}).status_code == 507
        same.close()
        assert other.via[1].post(f"/v1/ac/{key}/resolve",
                                 json={"job": "j0"}).status_code == 404
    finally:
        reader.close()
        other.close()
