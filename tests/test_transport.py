"""Client building blocks without torch.compile: config, breaker, packs, node cache, transport."""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import zstandard
from helpers import ServerProcess, free_port, sha256

from megacache_client.config import ClientConfig, ConfigError
from megacache_client.nodecache import NodeCache
from megacache_client.packs import (
    PackError,
    compress_bytes,
    decompress_bytes,
    pack_names,
    unpack,
    write_pack,
)
from megacache_client.transport import (
    CircuitBreaker,
    CircuitOpenError,
    CorruptBlobError,
    RemoteCache,
    TransportError,
)


def test_config_from_env_and_overrides(tmp_path: Path):
    env = {"MEGACACHE_URL": "http://127.0.0.1:1/", "MEGACACHE_MODE": "read-only",
           "MEGACACHE_READ_TIMEOUT_S": "2.5", "MEGACACHE_RETRIES": "0",
           "MEGACACHE_NODE_CACHE_DIR": str(tmp_path), "MEGACACHE_FALLBACK": "false"}
    cfg = ClientConfig.from_env(env)
    assert (cfg.url, cfg.mode, cfg.read_timeout_s, cfg.retries) == \
        ("http://127.0.0.1:1", "read-only", 2.5, 0)
    assert cfg.node_cache_dir == tmp_path and cfg.fallback is False
    assert cfg.enabled and not cfg.may_publish
    assert ClientConfig.from_env(env, mode="read-write").may_publish
    assert not ClientConfig.from_env({}).enabled  # no URL: off
    with pytest.raises(ConfigError, match="MEGACACHE_MODE"):
        ClientConfig.from_env({**env, "MEGACACHE_MODE": "sometimes"})
    with pytest.raises(ConfigError, match="READ_TIMEOUT_S"):
        ClientConfig.from_env({**env, "MEGACACHE_READ_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="http"):
        ClientConfig.from_env({"MEGACACHE_URL": "ftp://x"})


def test_circuit_breaker_opens_and_half_opens():
    b = CircuitBreaker(threshold=2, reset_s=0.2)
    b.check()
    b.failure()
    b.check()
    b.failure()
    with pytest.raises(CircuitOpenError):
        b.check()
    time.sleep(0.25)
    b.check()  # half-open: one attempt allowed
    b.failure()  # and it failed again: open at once
    with pytest.raises(CircuitOpenError):
        b.check()
    time.sleep(0.25)
    b.check()
    b.success()
    b.check()
    assert not b.is_open


def test_dead_server_fails_fast_once_the_breaker_opens(tmp_path: Path):
    cfg = ClientConfig(url=f"http://127.0.0.1:{free_port()}", retries=0, connect_timeout_s=0.5)
    breaker = CircuitBreaker(threshold=3, reset_s=60)
    with RemoteCache(cfg, breaker) as remote:
        for _ in range(3):
            with pytest.raises(TransportError):
                remote.get_entry("0" * 64)
        t = time.monotonic()
        with pytest.raises(CircuitOpenError):
            remote.get_entry("0" * 64)
        assert time.monotonic() - t < 0.05


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


def test_clients_share_one_tls_context(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A trainer makes several clients (prefetch, load, publish, report); the CA bundle is
    loaded once per process, not once per client (35-130 ms each). SSL_CERT_FILE is read
    as httpx reads it."""
    import ssl

    from megacache_client import transport

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


def test_pack_round_trip_is_deterministic(tmp_path: Path):
    src = tmp_path / "src"
    (src / "ab").mkdir(parents=True)
    (src / "ab" / "k1.so").write_bytes(os.urandom(5000))
    (src / "cd.so").write_bytes(b"x" * 10000)
    files = {"ab/k1.so": src / "ab" / "k1.so", "cd.so": src / "cd.so"}
    raw1, _ = write_pack(files.items(), tmp_path / "p1")
    os.utime(src / "cd.so", (1, 1))
    write_pack(reversed(list(files.items())), tmp_path / "p2")
    assert raw1 == 15000
    assert (tmp_path / "p1").read_bytes() == (tmp_path / "p2").read_bytes()
    assert pack_names(tmp_path / "p1", cap=10**6) == ["ab/k1.so", "cd.so"]
    out = tmp_path / "out"
    assert unpack(tmp_path / "p1", out, suffixes=(".so",), cap=10**6) == ["ab/k1.so", "cd.so"]
    assert (out / "ab" / "k1.so").read_bytes() == files["ab/k1.so"].read_bytes()
    assert os.access(out / "cd.so", os.X_OK)
    # already-present files are left alone
    assert unpack(tmp_path / "p1", out, suffixes=(".so",), cap=10**6) == []


def _evil_pack(path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


@pytest.mark.parametrize("name, kind", [
    ("../escape.so", tarfile.REGTYPE),
    ("/abs/escape.so", tarfile.REGTYPE),
    ("a/../../escape.so", tarfile.REGTYPE),
    ("link.so", tarfile.SYMTYPE),
    ("evil.py", tarfile.REGTYPE),
])
def test_unsafe_packs_are_refused(tmp_path: Path, name: str, kind: bytes):
    member = tarfile.TarInfo(name)
    member.type = kind
    member.size = 4 if kind == tarfile.REGTYPE else 0
    if kind == tarfile.SYMTYPE:
        member.linkname = "/etc/passwd"
    pack = _evil_pack(tmp_path / "evil", member, b"boom" if kind == tarfile.REGTYPE else b"")
    out = tmp_path / "out"
    with pytest.raises(PackError):
        unpack(pack, out, suffixes=(".so",), cap=10**6)
    assert not (tmp_path / "escape.so").exists()
    assert not any(out.rglob("*")) if out.exists() else True


def test_pack_and_bundle_caps(tmp_path: Path):
    (tmp_path / "big.so").write_bytes(b"\0" * 100_000)
    write_pack([("big.so", tmp_path / "big.so")], tmp_path / "p")
    with pytest.raises(PackError, match="cap"):
        unpack(tmp_path / "p", tmp_path / "out", suffixes=(".so",), cap=50_000)
    raw = b"\0" * 1_000_000
    data = compress_bytes(raw)
    assert decompress_bytes(data, len(raw), sha256(raw), cap=10**7) == raw
    with pytest.raises(PackError, match="cap"):
        decompress_bytes(data, len(raw), None, cap=1000)
    with pytest.raises(PackError):  # manifest lies about the raw size: torch never sees it
        decompress_bytes(data, 10, None, cap=10**7)
    with pytest.raises(PackError, match="raw_sha256"):
        decompress_bytes(data, len(raw), sha256(b"other"), cap=10**7)
    with pytest.raises(PackError, match="zstd"):
        decompress_bytes(b"not zstd at all", 10, None, cap=10**7)
    with pytest.raises(PackError, match="malformed"):
        pack_names(_write(tmp_path / "junk", b"junk"), cap=10**6)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_node_cache_downloads_once_for_many_ranks(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    from megacache_client import nodecache

    data = os.urandom(100_000)
    digest = sha256(data)
    calls = []
    at_lock: list[str] = []  # ranks that reached the blob's lock
    arrived = threading.Condition()
    file_lock = nodecache.FileLock

    class WatchedLock:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.lock = file_lock(*args, **kwargs)

        def __enter__(self) -> object:
            with arrived:
                at_lock.append(threading.current_thread().name)
                arrived.notify_all()
            return self.lock.__enter__()

        def __exit__(self, *exc: object) -> None:
            self.lock.__exit__(*exc)

    def download(tmp: Path) -> None:
        calls.append(1)
        with arrived:  # every other rank is at the lock before this download ends
            assert arrived.wait_for(lambda: len(at_lock) >= 4, timeout=20), at_lock
        tmp.write_bytes(data)

    monkeypatch.setattr(nodecache, "FileLock", WatchedLock)
    cache = NodeCache(tmp_path)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        NodeCache(tmp_path).fetch(digest, len(data), download))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(n for _, n in results) == [0, 0, 0, len(data)]
    # a copy corrupted on disk is detected and fetched again
    cache.path(digest).write_bytes(b"rot" + data[3:])
    path, n = cache.fetch(digest, len(data), download)
    assert n == len(data) and path.read_bytes() == data and len(calls) == 2
