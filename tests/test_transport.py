"""RemoteCache over the wire (megacache_client/transport/client.py): one TLS context per
process, verified and resumed downloads, an unused port failing fast."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import ServerProcess, free_port, sha256

from megacache_client.config import ClientConfig
from megacache_client.transport.breaker import CircuitBreaker
from megacache_client.transport.client import (
    CorruptBlobError,
    RemoteCache,
    TransportError,
)


def test_clients_share_one_tls_context(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A trainer makes several clients (prefetch, load, publish, report); the CA bundle is
    loaded once per process, not once per client (35-130 ms each). SSL_CERT_FILE is read
    as httpx reads it."""
    import ssl

    from megacache_client.transport import tls as transport

    made: list[object] = []
    real = ssl.create_default_context

    def counting(*args: object, **kwargs: object) -> ssl.SSLContext:
        made.append(kwargs.get("cafile"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl, "create_default_context", counting)
    monkeypatch.setattr(transport, "_tls", None)
    import certifi

    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(Path(certifi.where()).read_bytes())
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    cfg = ClientConfig(url=f"https://127.0.0.1:{free_port()}")
    contexts = set()
    for _ in range(3):
        with RemoteCache(cfg, CircuitBreaker()) as remote:
            remote._http  # noqa: B018 - built on first use
            contexts.add(id(transport.tls_context()))
    assert made == [str(bundle)] and len(contexts) == 1


class CuttingProxy:
    """A loopback proxy to the server that breaks the first response it forwards after
    `cut` bytes (head included), as a dropped connection does. One request per connection
    (it asks the server to close after answering); it keeps each request's head and each
    answer's status."""

    def __init__(self, upstream_port: int, cut: int) -> None:
        self.upstream_port, self.cut = upstream_port, cut
        self.heads: list[str] = []
        self.statuses: list[int] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(("127.0.0.1", self.upstream_port)) as up:
            head = b""
            while b"\r\n\r\n" not in head and (got := conn.recv(65536)):
                head += got
            lines = [line for line in head.decode("latin-1").split("\r\n")
                     if line and not line.lower().startswith("connection:")]
            self.heads.append("\r\n".join(lines))
            limit = self.cut if len(self.heads) == 1 else None
            up.sendall("\r\n".join([*lines, "connection: close", "", ""]).encode("latin-1"))
            sent = 0
            while data := up.recv(65536):
                if sent == 0:
                    self.statuses.append(int(data.split(b" ", 2)[1]))
                if limit is not None and sent + len(data) >= limit:
                    conn.sendall(data[:limit - sent])
                    return  # cut mid-body: the client sees the connection break
                conn.sendall(data)
                sent += len(data)

    def close(self) -> None:
        self.sock.close()


def test_download_verifies_and_resumes(server: ServerProcess, tmp_path: Path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    digest = sha256(data)
    httpx.put(f"{server.url}/v1/cas/{digest}", content=data)
    cut = CuttingProxy(server.port, cut=(3 * 1024 * 1024) // 2)
    try:  # the connection breaks half way: the client asks for the rest and gets 206
        with RemoteCache(ClientConfig(url=cut.url), CircuitBreaker()) as remote:
            got = remote.download_blob(digest, len(data), tmp_path / "resumed")
    finally:
        cut.close()
    assert got == digest and (tmp_path / "resumed").read_bytes() == data
    assert len(cut.heads) == 2 and cut.statuses == [200, 206], (cut.heads, cut.statuses)
    assert "range:" not in cut.heads[0].lower()
    [rng] = [h for h in cut.heads[1].split("\r\n") if h.lower().startswith("range:")]
    start = int(rng.split("=")[1].rstrip("-"))
    assert 0 < start < cut.cut and rng.lower() == f"range: bytes={start}-", rng

    cfg = ClientConfig(url=server.url)
    with RemoteCache(cfg, CircuitBreaker()) as remote:
        dest = tmp_path / "blob"
        remote.download_blob(digest, len(data), dest)
        assert dest.read_bytes() == data
        with pytest.raises(CorruptBlobError):  # the manifest lies about the size
            remote.download_blob(digest, len(data) - 1, tmp_path / "short")
        assert not (tmp_path / "short").exists()
        with pytest.raises(TransportError) as err:
            remote.download_blob(sha256(b"absent"), 5, tmp_path / "absent")
        assert err.value.status == 404


def test_unused_port_fails_fast():
    cfg = ClientConfig(url=f"http://127.0.0.1:{free_port()}", retries=0)
    t = time.monotonic()
    with RemoteCache(cfg, CircuitBreaker()) as remote, pytest.raises(TransportError):
        remote.get_entry("0" * 64)
    assert time.monotonic() - t < 2
