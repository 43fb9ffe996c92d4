"""Hostile and broken requests: each gets its status and a JSON error, writes nothing, and
leaves the server serving everyone else."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import ServerProcess, raw_http, sha256


@pytest.fixture(scope="module", params=BACKENDS)
def strict(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """A server that gives up on a stalled upload after one second, and on one slower than
    64 KiB/s after two."""
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(tmp_path_factory.mktemp("strict") / "data", *args,
                                     env={**env, "MEGACACHE_UPLOAD_IDLE_TIMEOUT_S": "1",
                                          "MEGACACHE_MIN_UPLOAD_GRACE_S": "2"}),
                       request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def test_stalled_upload_times_out_and_leaves_nothing(strict: ServerProcess):
    data = os.urandom(20 * 1024 * 1024)  # multipart territory on S3
    digest = sha256(data)
    with socket.create_connection(("127.0.0.1", strict.port), timeout=30) as s:
        s.sendall(f"PUT /v1/cas/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}"
                  f"\r\n\r\n".encode() + data[:18 * 1024 * 1024])
        started = time.monotonic()
        response = s.recv(65536)  # then we stall: the server must answer by itself
        while b"upload stalled" not in response and time.monotonic() - started < 20:
            more = s.recv(65536)
            if not more:
                break
            response += more
        assert time.monotonic() - started < 20
    assert response.startswith(b"HTTP/1.1 408"), response[:200]
    assert b"upload stalled" in response
    deadline = time.monotonic() + 10
    while strict.temp_files() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert strict.temp_files() == []
    with httpx.Client(base_url=strict.url, timeout=30) as c:
        assert c.head(f"/v1/cas/{digest}").status_code == 404
        assert c.put(f"/v1/cas/{digest}", content=data).status_code == 201  # others fine


@pytest.mark.parametrize("route", ["blob", "manifest"])
def test_a_body_dripped_below_the_minimum_rate_is_cut_off(strict: ServerProcess, route: str):
    """A byte every 0.3 s keeps the idle timer (1 s) from firing; the minimum rate does not
    let it hold its slot: 408 once the grace period (2 s) is over, nothing stored."""
    data = os.urandom(1024 * 1024)
    path = f"/v1/cas/{sha256(data)}" if route == "blob" else f"/v1/ac/{sha256(data)}"
    length = len(data) if route == "blob" else 4000
    response = b""
    with socket.create_connection(("127.0.0.1", strict.port), timeout=30) as s:
        s.sendall(f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}"
                  "\r\n\r\n".encode())
        s.settimeout(0.3)
        started = time.monotonic()
        for i in range(60):  # 18 s at most
            try:
                s.sendall(data[i:i + 1])
                response += s.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # the server answered and closed
                break
            if response:
                break
        elapsed = time.monotonic() - started
        s.settimeout(5)
        with contextlib.suppress(OSError):  # the body may come in a later segment
            while b"\r\n\r\n" in response and len(response.split(b"\r\n\r\n", 1)[1]) \
                    < _content_length(response):
                more = s.recv(65536)
                if not more:
                    break
                response += more
    assert response.startswith(b"HTTP/1.1 408"), (elapsed, response[:200])
    assert b"upload_too_slow" in response and elapsed < 6, (elapsed, response[:300])
    deadline = time.monotonic() + 10
    while strict.temp_files() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert strict.temp_files() == []
    assert httpx.head(f"{strict.url}/v1/cas/{sha256(data)}").status_code == 404


def _content_length(response: bytes) -> int:
    head = response.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    return next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                 if line.startswith("content-length:")), 0)


def test_an_upload_above_the_minimum_rate_goes_through(strict: ServerProcess):
    from helpers import SlowLink

    data = os.urandom(1024 * 1024)  # ~4 s at 256 KiB/s: past the 2 s grace, above 64 KiB/s
    with SlowLink(strict.port, rate=256 * 1024) as link:
        r = httpx.put(f"{link.url}/v1/cas/{sha256(data)}", content=data, timeout=60)
    assert r.status_code == 201, r.text


def test_huge_headers_are_refused_and_the_server_keeps_serving(strict: ServerProcess):
    status, _ = raw_http(strict.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
                         + b"a" * 200_000 + b"\r\nConnection: close\r\n\r\n")
    assert status == 431
    assert httpx.get(f"{strict.url}/healthz").status_code == 200


def test_negative_and_garbage_content_length(strict: ServerProcess):
    digest = sha256(b"x")
    for value in (b"-5", b"abc", b"1e3"):
        status, response = raw_http(strict.port, b"PUT /v1/cas/" + digest.encode() +
                                    b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + value +
                                    b"\r\nConnection: close\r\n\r\n")
        assert status == 400, (value, response[:200])
    assert httpx.head(f"{strict.url}/v1/cas/{digest}").status_code == 404


def test_every_error_is_json(strict: ServerProcess):
    with httpx.Client(base_url=strict.url) as c:
        for method, path in (("GET", "/nope"), ("POST", "/v1/cas/" + "0" * 64),
                             ("GET", "/v1/ac/" + "0" * 64), ("PUT", "/v1/ac/xyz"),
                             ("GET", "/v1/ac?limit=-1")):
            r = c.request(method, path)
            assert r.status_code >= 400
            assert r.headers["content-type"] == "application/json", (method, path)
            assert r.json()["error"]["message"], (method, path)
