"""Hostile input that used to get through: each case is one a tenant, a proxy or a server
in front of the client can send, and each test fails without its fix."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest
from helpers import ServerProcess

BLOB = b"megacache" * 100
DIGEST = hashlib.sha256(BLOB).hexdigest()
HUGE = "9" * 5000


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("hostile") / "data").start()
    yield server
    server.stop()


@pytest.mark.parametrize("header, status, body", [
    (f"bytes={HUGE}-", 416, None),  # starts past any blob
    (f"bytes=0-{HUGE}", 206, BLOB),  # ends past the blob: the whole of it
    (f"bytes=-{HUGE}", 206, BLOB),  # a suffix longer than the blob: all of it
    (f"bytes={'0' * 5000}5-9", 206, BLOB[5:10]),  # leading zeros are still a small number
])
def test_ranges_of_thousands_of_digits_are_answered_not_raised(plain: ServerProcess,
                                                               header: str, status: int,
                                                               body: bytes | None):
    with httpx.Client(base_url=plain.url) as c:
        assert c.put(f"/v1/cas/{DIGEST}", content=BLOB).status_code in (200, 201)
        r = c.get(f"/v1/cas/{DIGEST}", headers={"range": header})
        assert r.status_code == status, (r.status_code, r.text[:200])
        if body is not None:
            assert r.content == body
    assert "Traceback" not in plain.log()


def _wait_for(server: ServerProcess, text: str) -> str:
    import time

    deadline = time.monotonic() + 10
    while text not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)  # access log lines are written after the response
    return server.log()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_token_reaches_the_logs_however_it_is_spelled(tmp_path, fmt: str):
    server = ServerProcess(tmp_path / "data", "--auth", "--log-format", fmt,
                           log_level="info").start()
    try:
        token = server.token("read", name="spy")
        secret = token.split("_", 2)[2]
        with httpx.Client(base_url=server.url) as c:
            # an encoded `=`, a token in the path, a token as the request id
            c.get(f"/?x=1&token%3D{token}&mark=encoded")
            c.get(f"/v1/cas/{token}", headers={"authorization": f"Bearer {token}"})
            c.get("/v1/stats?mark=rid", headers={"authorization": f"Bearer {token}",
                                                 "x-request-id": token})
        log = _wait_for(server, "mark=rid" if fmt == "text" else '"request_id"')
        if fmt == "json":  # the JSON access log names paths, not queries: wait for the 3rd
            import time

            deadline = time.monotonic() + 10
            while server.log().count('"request_id"') < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            log = server.log()
            assert log.count('"request_id"') >= 3, log[-2000:]
        else:
            assert "mark=encoded" in log
        assert secret not in log, log[-2000:]
    finally:
        server.stop()
