"""RemoteCache over the wire (megacache_client/transport/client.py): one TLS context per
process, verified and resumed downloads, an unused port failing fast."""

from __future__ import annotations

import os
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

    from megacache_client.transport import client as transport

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


def test_download_verifies_and_resumes(server: ServerProcess, tmp_path: Path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    digest = sha256(data)
    httpx.put(f"{server.url}/v1/cas/{digest}", content=data)
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
