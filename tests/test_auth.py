"""Tokens, scopes and namespaces (manifest signing: test_signing.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256

from megacache_server.settings import Settings


@pytest.fixture(scope="module", params=BACKENDS)
def secure(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(tmp_path_factory.mktemp("secure") / "data", *args,
                                     "--auth", env={**env, "MEGACACHE_TOKEN_CACHE_S": "0"}),
                       request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_missing_and_bad_tokens_are_401(secure: ServerProcess):
    data = os.urandom(100)
    url = f"{secure.url}/v1/cas/{sha256(data)}"
    r = httpx.put(url, content=data)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert r.headers["www-authenticate"].startswith("Bearer")
    for bad in ("mc_nope_nope", "garbage", secure.token("read")[:-2] + "xx"):
        r = httpx.put(url, content=data, headers=bearer(bad))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token", bad
    assert httpx.get(f"{secure.url}/v1/stats").status_code == 401
    assert httpx.get(f"{secure.url}/healthz").status_code == 200  # probes need no token


def test_scopes_are_403_with_the_missing_one_named(secure: ServerProcess):
    reader, writer, admin = (secure.token(s) for s in ("read", "read,write", "admin"))
    data = os.urandom(100)
    r = httpx.put(f"{secure.url}/v1/cas/{sha256(data)}", content=data, headers=bearer(reader))
    assert r.status_code == 403
    assert (r.json()["error"]["code"], r.json()["error"]["required"]) == ("missing_scope",
                                                                          "write")
    assert httpx.put(f"{secure.url}/v1/cas/{sha256(data)}", content=data,
                     headers=bearer(writer)).status_code == 201
    m = make_manifest({"megacache": data}, make_fingerprint(code="scoped"))
    assert httpx.put(f"{secure.url}/v1/ac/{m.key}", content=m.to_json(),
                     headers=bearer(writer)).status_code == 201
    assert httpx.get(f"{secure.url}/v1/ac/{m.key}", headers=bearer(reader)).status_code == 200
    r = httpx.delete(f"{secure.url}/v1/ac/{m.key}", headers=bearer(writer))
    assert r.status_code == 403 and r.json()["error"]["required"] == "admin"
    assert httpx.put(f"{secure.url}/v1/ac/{m.key}/pin",
                     headers=bearer(writer)).status_code == 403
    assert httpx.delete(f"{secure.url}/v1/ac/{m.key}", headers=bearer(admin)).status_code == 204


def test_revoked_token_is_refused(secure: ServerProcess):
    token = secure.token("read")
    assert httpx.get(f"{secure.url}/v1/stats", headers=bearer(token)).status_code == 200
    token_id = token.split("_")[1]
    listed = secure.cli("token", "list").splitlines()
    assert any(line.startswith(token_id) for line in listed), listed
    head = listed[0]  # a table: every row's state starts under the header's
    assert head.split() == ["id", "name", "scopes", "namespace", "state"], head
    assert {line.index(line.split()[4]) for line in listed[1:]} == {head.index("state")}
    secure.cli("token", "revoke", token_id)
    r = httpx.get(f"{secure.url}/v1/stats", headers=bearer(token))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
    assert "revoked" in secure.cli("token", "list")


def test_namespaces_do_not_see_each_other(secure: ServerProcess):
    a = bearer(secure.token("read,write", namespace="team-a"))
    b = bearer(secure.token("read,write", namespace="team-b"))
    data = os.urandom(5000)
    digest = sha256(data)
    with httpx.Client(base_url=secure.url) as c:
        assert c.put(f"/v1/cas/{digest}", content=data, headers=a).status_code == 201
        m = make_manifest({"megacache": data},
                          make_fingerprint(code="ns", namespace="team-a"))
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json(), headers=a).status_code == 201
        # team b cannot learn that the blob or the entry exists
        assert c.head(f"/v1/cas/{digest}", headers=b).status_code == 404
        assert c.get(f"/v1/cas/{digest}", headers=b).status_code == 404
        assert c.get(f"/v1/ac/{m.key}", headers=b).status_code == 404
        assert c.get("/v1/ac", params={"model": "mlp"}, headers=b).json() == {"entries": []}
        assert c.get("/v1/ac", params={"namespace": "team-a"}, headers=b).status_code == 403
        # nor write into team a's namespace
        r = c.put(f"/v1/ac/{m.key}", content=m.to_json(), headers=b)
        assert r.status_code == 403 and r.json()["error"]["code"] == "namespace_mismatch"
        # nor name team a's blob without having uploaded the bytes itself
        mb = make_manifest({"megacache": data}, make_fingerprint(code="ns", namespace="team-b"))
        assert c.put(f"/v1/ac/{mb.key}", content=mb.to_json(), headers=b).status_code == 424
        r = c.put(f"/v1/cas/{digest}", content=data, headers=b)
        assert r.status_code == 201  # "new to you", though the CAS already had the bytes
        assert c.put(f"/v1/ac/{mb.key}", content=mb.to_json(), headers=b).status_code == 201
        assert [e["key"] for e in c.get("/v1/ac", headers=a).json()["entries"]] == [m.key]


def test_tokens_are_stored_hashed(secure: ServerProcess):
    token = secure.token("read", name="hash-check")
    httpx.get(f"{secure.url}/v1/stats", headers=bearer(token))
    secret = token.split("_", 2)[2]
    if secure.backend.startswith("sqlite"):
        for f in secure.data_dir.glob("index.sqlite3*"):
            assert secret.encode() not in f.read_bytes()
    assert secret not in secure.log()
    assert secret not in secure.cli("token", "list")


def test_unauthenticated_serving_is_loopback_only(tmp_path: Path):
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        assert Settings(host=host).exposure_problem() is not None
        assert Settings(host=host, auth=True).exposure_problem() is None
        assert Settings(host=host, insecure=True).exposure_problem() is None
    for host in ("127.0.0.1", "localhost", "::1"):
        assert Settings(host=host).exposure_problem() is None
    out = subprocess.run([sys.executable, "-m", "megacache_server", "--host", "0.0.0.0",
                          "--data-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 3 and "refusing to serve without authentication" in out.stderr

