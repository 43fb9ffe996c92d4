"""Header bytes, header time and open connections are bounded while reading, with real
sockets against a real server.
"""

from __future__ import annotations

import hashlib
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import environment_missing
from helpers import LOOPBACK, ServerProcess

HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("bounded") / "data",
                           env={"MEGACACHE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}).start()
    yield server
    server.stop()
    assert "Traceback" not in server.log()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def read_response(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a
    close). A socket still open at its timeout fails the test: "closed" is what the callers
    check, and bytes read so far would pass for it."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {s.gettimeout()}s "
                    f"after sending {data[:200]!r}")
    return data


def test_oversized_header_block_is_431_while_reading(bounded: ServerProcess):
    with socket.create_connection((LOOPBACK, bounded.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000)
        response = read_response(s)  # no end of headers sent: only the size can end this
    assert response.startswith(b"HTTP/1.1 431 "), response[:200]
    assert b'"headers_too_large"' in response


def test_a_150_mib_header_line_costs_neither_memory_nor_others_time(bounded: ServerProcess):
    assert bounded.proc is not None
    before = rss_kib(bounded.proc.pid)
    sent, chunk = 0, b"a" * (1 << 20)
    with socket.create_connection((LOOPBACK, bounded.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        try:
            while sent < 150 * (1 << 20):
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = read_response(s)  # 431, or nothing when the close raced our sending
        assert response == b"" or response.startswith(b"HTTP/1.1 431 "), response[:200]
        # others are served meanwhile
        assert httpx.get(bounded.url + "/healthz", timeout=10).status_code == 200
    # the server stopped reading long before 150 MiB (socket buffers hold a few MiB)
    assert sent < 32 * (1 << 20), sent
    assert rss_kib(bounded.proc.pid) - before < 32 * 1024


def test_silent_and_dripping_connections_are_closed(bounded: ServerProcess):
    silent = socket.create_connection((LOOPBACK, bounded.port), timeout=HEADER_TIMEOUT_S * 8)
    drip = socket.create_connection((LOOPBACK, bounded.port), timeout=HEADER_TIMEOUT_S * 8)
    try:
        request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 100
        drip_closed = None
        for i, byte in enumerate(request):  # one byte every 0.2 s: never a full header block
            try:
                drip.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                drip_closed = i
                break
            time.sleep(0.2)
        response = read_response(drip)
        assert drip_closed is not None or response.startswith(b"HTTP/1.1 408 "), response
        assert read_response(silent) == b""  # closed without a word: it never asked
    finally:
        silent.close()
        drip.close()


def test_idle_sockets_cannot_exhaust_descriptors(bounded: ServerProcess):
    """1,100 idle sockets against a process limited to 1,024 descriptors: the longest idle
    are closed to make room, and a newcomer is served."""
    assert bounded.proc is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1500 and (hard == resource.RLIM_INFINITY or hard >= 1500):
        resource.setrlimit(resource.RLIMIT_NOFILE, (1500, hard))
    elif soft < 1500:
        environment_missing("1,500 descriptors for this test process",
                            f"the hard limit is {hard} (ulimit -Hn)")
    # hard limit too (the server raises its soft limit up to the hard one); for good
    resource.prlimit(bounded.proc.pid, resource.RLIMIT_NOFILE, (1024, 1024))
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection((LOOPBACK, bounded.port), timeout=10))
        r = httpx.get(bounded.url + "/healthz", timeout=10)
        assert r.status_code == 200
        for s in idle:  # every idle socket ends closed: shed early, or at the header timeout
            s.settimeout(HEADER_TIMEOUT_S * 8)
            assert read_response(s) == b""
    finally:
        for s in idle:
            s.close()
    assert httpx.get(bounded.url + "/healthz", timeout=10).status_code == 200


def test_bodies_and_pipelined_requests_do_not_count_as_header_bytes(bounded: ServerProcess):
    """Headers and a 300 KiB body in one write; then two requests in one write."""
    body = b"b" * (300 * 1024)
    digest = hashlib.sha256(body).hexdigest()
    with socket.create_connection((LOOPBACK, bounded.port), timeout=10) as s:
        s.sendall(f"PUT /v1/cas/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        assert read_response(s).startswith(b"HTTP/1.1 201 ")
    get = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection((LOOPBACK, bounded.port), timeout=10) as s:
        s.sendall(get + get[:-2] + b"Connection: close\r\n\r\n")
        assert read_response(s).count(b"HTTP/1.1 200 ") == 2
