"""The bytes every target serves: random blob files, stored in our server and in Redis,
and one valid entry (manifest) naming a blob, for the lookup job."""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness.benchlib import MiB
from benchmarks.harness.servers import LocalServer
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest

from .wire import connect, put_head, read_response, send_file


@dataclass(frozen=True)
class Blob:
    """A fixture file and its sha256 (the hash object too: uploads append a unique tail)."""

    path: Path
    size: int
    sha: Any  # hashlib sha256 state after the whole file

    @property
    def digest(self) -> str:
        return str(self.sha.hexdigest())


def make_blob(path: Path, size: int) -> Blob:
    """Random bytes (incompressible, like a zstd bundle), hashed as they are written."""
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 8 * MiB))
            sha.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return Blob(path, size, sha)


def redis_set(port: int, key: str, blob: Blob) -> None:
    """SET key <file bytes> over RESP, the value sent by sendfile."""
    head = (f"*3\r\n$3\r\nSET\r\n${len(key)}\r\n{key}\r\n${blob.size}\r\n").encode()
    with connect(port) as sock:
        send_file(sock, head, blob.path, blob.size, b"\r\n")
        reply = sock.recv(64)
    if not reply.startswith(b"+OK"):
        raise RuntimeError(f"redis SET failed: {reply!r}")


def put_fixture(port: int, blob: Blob) -> None:
    """Store a fixture blob in our server (201, or 200 if it is there already)."""
    path = f"/v1/cas/{blob.digest}"
    with connect(port) as sock:
        send_file(sock, put_head(path, blob.size), blob.path, blob.size, b"")
        if not (read_response(sock, "http", 201)):
            raise RuntimeError(f"PUT {path} failed")


def create_entry(server: LocalServer, blob: Blob) -> tuple[str, bytes]:
    """PUT a valid manifest naming `blob`; returns the key and the manifest bytes GET serves."""
    import httpx

    fp = Fingerprint(model="bench-model", code="bench",
                     env={"torch": "2.13.0", "python": "3.11", "cuda": None},
                     hw={"arch": platform.machine(), "isa": "avx2", "cxx": "g++ 12.2.0"},
                     config={"backend": "inductor", "mode": "default"})
    manifest = Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0",
                        blobs=[BlobRef(digest=blob.digest, size=blob.size, role="megacache",
                                       compression="none")],
                        artifact_counts={"inductor": 12, "aot_autograd": 4},
                        cold_compile_s=184.2, created_at=datetime.now(timezone.utc),
                        producer={"client": "server_bench"})
    url = f"{server.url}/v1/ac/{manifest.key}"
    httpx.put(url, content=manifest.to_json(), timeout=30).raise_for_status()
    got = httpx.get(url, timeout=30)
    got.raise_for_status()
    return manifest.key, got.content
