"""Smaller holes, each closed: tokens in access logs, suffix ranges of an empty
blob, index durability, token expiry and namespaces, and a server without auth reached
through a browser (DNS rebinding, cross-site form posts).
"""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import ServerProcess

from megacache_server.store.index.sqlite import SqliteIndex

EMPTY = hashlib.sha256(b"").hexdigest()


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Auth on, text access log at info level (what a default deployment writes)."""
    server = ServerProcess(tmp_path_factory.mktemp("hard") / "data", "--auth",
                           log_level="info").start()
    yield server
    server.stop()
    assert "Traceback" not in server.log()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Auth off (loopback), with one extra allowed host name."""
    server = ServerProcess(tmp_path_factory.mktemp("open") / "data",
                           env={"MEGACACHE_ALLOWED_HOSTS": "cache.internal"}).start()
    yield server
    server.stop()
    assert "Traceback" not in server.log()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_dashboard_token_in_the_url_is_not_logged(secure: ServerProcess):
    token = secure.token("read", name="dash")
    r = httpx.get(f"{secure.url}/?token={token}&theme=dark")
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while "theme=dark" not in secure.log() and time.monotonic() < deadline:
        time.sleep(0.1)  # the access log line is written after the response
    log = secure.log()
    assert "token=redacted&theme=dark" in log
    assert token not in log and token.split("_", 2)[2] not in log


@pytest.mark.parametrize("header", ["bytes=-5", "bytes=0-", "bytes=0-0"])
def test_any_range_of_an_empty_blob_is_416(server: ServerProcess, header: str):
    with httpx.Client(base_url=server.url) as c:
        assert c.put(f"/v1/cas/{EMPTY}", content=b"").status_code in (200, 201)
        r = c.get(f"/v1/cas/{EMPTY}", headers={"range": header})
        assert r.status_code == 416, (header, r.status_code, r.headers)
        assert r.headers["content-range"] == "bytes */0"
        assert c.get(f"/v1/cas/{EMPTY}").status_code == 200  # no range: the empty body


def test_index_commits_are_synced_before_acknowledging(tmp_path: Path):
    """synchronous=FULL: in WAL mode NORMAL may lose the last acknowledged commits on power
    loss; FULL syncs the WAL at every commit."""
    import asyncio

    index = SqliteIndex(tmp_path / "index.sqlite3")
    asyncio.run(index.open())
    try:
        assert index._conn is not None
        assert index._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert index._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        asyncio.run(index.close())


def test_tokens_expire(secure: ServerProcess):
    token = secure.cli("token", "create", "--name", "short", "--scopes", "read",
                       "--expires", "3s")
    assert httpx.get(f"{secure.url}/v1/stats", headers=bearer(token)).status_code == 200
    time.sleep(3.2)
    r = httpx.get(f"{secure.url}/v1/stats", headers=bearer(token))
    assert r.status_code == 401 and r.json()["error"]["code"] == "token_expired"
    assert "expired" in secure.cli("token", "list")
    lasting = secure.cli("token", "create", "--name", "long", "--scopes", "read",
                         "--expires", "30d")
    assert httpx.get(f"{secure.url}/v1/stats", headers=bearer(lasting)).status_code == 200


@pytest.mark.parametrize("flags, message", [
    (["--namespace", "Team A"], "namespace 'Team A' is not valid"),
    (["--namespace=-x"], "is not valid"),
    (["--namespace", "a" * 65], "is not valid"),
    (["--expires", "soon"], "is not a duration"),
    (["--expires", "0"], "must be positive"),
])
def test_token_creation_refuses_bad_namespaces_and_lifetimes(tmp_path: Path,
                                                             flags: list[str], message: str):
    out = subprocess.run([sys.executable, "-m", "megacache_server", "token", "create",
                          "--name", "x", "--data-dir", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    listed = subprocess.run([sys.executable, "-m", "megacache_server", "token", "list",
                             "--data-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert listed.stdout.strip() == ""  # nothing was stored


def test_without_auth_only_loopback_and_configured_hosts_are_served(open_server: ServerProcess):
    url = open_server.url + "/healthz"
    for host in ("evil.example", "evil.example:8787", "127.0.0.1.nip.io", "[::2]:1"):
        r = httpx.get(url, headers={"host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", host
    for host in ("localhost", f"localhost:{open_server.port}", f"127.0.0.1:{open_server.port}",
                 "[::1]:8787", "cache.internal", "CACHE.internal:80"):
        assert httpx.get(url, headers={"host": host}).status_code == 200, host


def test_without_auth_cross_site_form_posts_are_refused(open_server: ServerProcess):
    body = b"model=x&outcome=hit"  # what a hostile page's <form> would send
    url = open_server.url + "/v1/events"
    form = {"content-type": "application/x-www-form-urlencoded"}
    for extra in ({"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"},
                  {"origin": "null"}, {"content-type": "text/plain",
                                        "origin": "https://evil.example"}):
        r = httpx.post(url, content=body, headers={**form, **extra})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request", extra
    digest = hashlib.sha256(b"x").hexdigest()
    r = httpx.put(f"{open_server.url}/v1/cas/{digest}", content=b"x",
                  headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    assert httpx.head(f"{open_server.url}/v1/cas/{digest}").status_code == 404  # not stored
    # the same origin (the dashboard) and programs without browser headers are served
    same = {"origin": open_server.url, "sec-fetch-site": "same-origin"}
    assert httpx.put(f"{open_server.url}/v1/cas/{digest}", content=b"x",
                     headers=same).status_code == 201
    assert httpx.get(open_server.url + "/v1/stats",
                     headers={"origin": "http://evil.example"}).status_code == 200


def test_with_auth_the_token_decides_not_the_host(secure: ServerProcess):
    token = secure.token("read", name="any-host")
    r = httpx.get(f"{secure.url}/v1/stats", headers={"host": "cache.example.com",
                                                     **bearer(token)})
    assert r.status_code == 200


def test_an_index_of_another_schema_is_refused_with_a_clear_error(tmp_path: Path):
    """Pre-release data dirs are not migrated: the server says so instead of misreading."""
    import asyncio

    path = tmp_path / "index.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, manifest BLOB)")
    with pytest.raises(RuntimeError, match="schema 0"):
        asyncio.run(SqliteIndex(path).open())
