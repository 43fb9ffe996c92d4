"""Test helpers: a real megacache-server process on a free loopback port, raw HTTP, manifests."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from megacache_client.manifest import BlobRef, Fingerprint, Manifest

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`megacache-server` run exactly as a user runs it, in its own process."""

    def __init__(self, data_dir: Path, *extra_args: str, env: dict[str, str] | None = None):
        self.data_dir = data_dir
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        cmd = [sys.executable, "-m", "megacache_server", "--host", LOOPBACK,
               "--port", str(self.port), "--log-level", "warning", *self.extra_args]
        if "MEGACACHE_DATA_DIR" not in self.env:
            cmd += ["--data-dir", str(self.data_dir)]
        env = {**os.environ, **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def temp_files(self) -> list[Path]:
        return sorted((self.data_dir / "tmp").glob("*"))

    def blob_files(self) -> list[Path]:
        return sorted(p for p in (self.data_dir / "cas").glob("*/*"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def raw_http(port: int, request: bytes, *, close_write: bool = False,
             timeout: float = 10.0) -> tuple[int, bytes]:
    """Send bytes as they are (for bodies shorter than declared, chunked, odd headers).

    Returns the status code and the raw response.
    """
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
        s.sendall(request)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = s.recv(65536)
            if not chunk:
                break
            response += chunk
    if not response:
        return 0, b""
    return int(response.split(b" ", 2)[1]), response


def make_fingerprint(model: str = "mlp", code: str = "c0", **overrides: object) -> Fingerprint:
    base: dict[str, object] = {
        "model": model,
        "code": code,
        "env": {"torch": "2.13.0", "python": "3.11", "cuda": None},
        "hw": {"arch": "x86_64", "isa": "avx2", "cxx": "g++ 12.2.0"},
        "config": {"backend": "inductor", "mode": "default"},
    }
    base.update(overrides)
    return Fingerprint.model_validate(base)


def make_manifest(blobs: dict[str, bytes] | list[tuple[str, bytes]],
                  fingerprint: Fingerprint | None = None,
                  created_at: datetime | None = None, cold_compile_s: float = 12.5) -> Manifest:
    fp = fingerprint or make_fingerprint()
    items = blobs.items() if isinstance(blobs, dict) else blobs
    refs = [BlobRef(digest=sha256(data), size=len(data), role=role, compression="none")
            for role, data in items]
    return Manifest(
        key=fp.key(),
        blobs=refs,
        fingerprint=fp,
        torch_version="2.13.0",
        artifact_counts={"inductor": 2, "aot_autograd": 1},
        cold_compile_s=cold_compile_s,
        created_at=created_at or datetime.now(timezone.utc),
        producer={"client": "tests"},
    )
