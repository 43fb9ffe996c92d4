"""The retry loop (megacache_client/transport/retry.py): backoff, Retry-After, the deadline,
and hung servers bounded by the deadline and the read timeout."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megacache_client.config import ClientConfig
from megacache_client.transport.breaker import CircuitBreaker
from megacache_client.transport.client import (
    CircuitOpenError,
    DeadlineExceeded,
    RemoteCache,
    TransportError,
)
from megacache_client.transport.retry import Deadline, retry_after_s


class Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next scripted (status, headers, body); logs the time."""

    script: list[tuple[int, dict[str, str], bytes]] = []
    seen: list[tuple[float, str]] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).seen.append((time.monotonic(), self.path))
        status, headers, body = type(self).script.pop(0)
        self.send_response(status)
        for k, v in {"content-length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[type[Scripted]]:
    handler = type("Handler", (Scripted,), {"script": [], "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()
    server.server_close()


def test_retry_after_is_honoured(scripted):
    scripted.script = [(503, {"retry-after": "1"}, b"busy"), (404, {}, b"")]
    with RemoteCache(ClientConfig(url=scripted.url), CircuitBreaker()) as remote:
        assert remote.get_entry("0" * 64) is None
    (t1, _), (t2, _) = scripted.seen
    assert t2 - t1 >= 0.95  # waited what the server asked, not the 0.1-0.3 s backoff


def test_retry_after_longer_than_the_deadline_gives_up_and_opens_the_breaker(scripted):
    scripted.script = [(503, {"retry-after": "120"}, b"busy")]
    breaker = CircuitBreaker()
    with RemoteCache(ClientConfig(url=scripted.url), breaker, Deadline(2)) as remote:
        with pytest.raises(DeadlineExceeded):
            remote.get_entry("0" * 64)
        with pytest.raises(CircuitOpenError):  # the server said: not for two minutes
            remote.get_entry("0" * 64)
    assert len(scripted.seen) == 1


def test_a_5xx_on_a_blob_download_is_retried(scripted, tmp_path: Path):
    data = os.urandom(10_000)
    digest = hashlib.sha256(data).hexdigest()
    scripted.script = [(502, {}, b"bad gateway"), (200, {}, data)]
    breaker = CircuitBreaker(threshold=3)
    with RemoteCache(ClientConfig(url=scripted.url), breaker) as remote:
        remote.download_blob(digest, len(data), tmp_path / "blob")
    assert (tmp_path / "blob").read_bytes() == data
    assert [p for _, p in scripted.seen] == [f"/v1/cas/{digest}"] * 2
    assert not breaker.is_open


def test_retry_after_as_http_date():
    assert retry_after_s("7") == 7.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert retry_after_s("not a date") is None


def test_hung_server_is_bounded_by_the_deadline_not_the_read_timeout():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    try:
        cfg = ClientConfig(url=f"http://127.0.0.1:{listener.getsockname()[1]}", retries=2,
                           read_timeout_s=30)
        breaker = CircuitBreaker()
        with RemoteCache(cfg, breaker, Deadline(1.0)) as remote, \
                pytest.raises(TransportError, match="1s load deadline"):
            remote.get_entry("0" * 64)
        assert breaker.is_open  # the node's other ranks will not wait on it too
    finally:
        listener.close()


def test_hanging_server_is_bounded_by_the_read_timeout():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    port = listener.getsockname()[1]
    try:
        cfg = ClientConfig(url=f"http://127.0.0.1:{port}", retries=1, read_timeout_s=0.5)
        with RemoteCache(cfg, CircuitBreaker()) as remote:
            t = time.monotonic()
            with pytest.raises(TransportError, match="ReadTimeout"):
                remote.get_entry("0" * 64)
            assert time.monotonic() - t < 5
    finally:
        listener.close()


def test_a_deadline_spent_before_the_first_try_does_not_mark_the_server_down(scripted):
    """The budget ran out while the trainer was busy (a prefetch continued long after
    import): nothing was asked, so the server is not marked down for the node's ranks."""
    cfg = ClientConfig(url=scripted.url, retries=2)  # type: ignore[attr-defined]
    scripted.script.append((404, {}, b"{}"))
    breaker = CircuitBreaker()
    spent = Deadline(0.01)
    time.sleep(0.05)
    with RemoteCache(cfg, breaker, spent) as remote, \
            pytest.raises(TransportError, match="no attempt made"):
        remote.get_entry("0" * 64)
    assert not breaker.is_open
    with RemoteCache(cfg, breaker, Deadline(10)) as remote:  # the next step asks, and is heard
        assert remote.get_entry("0" * 64) is None
