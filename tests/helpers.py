"""Test helpers: a real megacache-server process on a free loopback port, raw HTTP, manifests."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.machines import GxxCounter, JobRun, Machine, run_job
from benchmarks.harness.servers import LOOPBACK, LocalServer, free_port
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest
from megacache_client.wire.schema import parse
from megacache_server.store.index.base import Index

__all__ = ["LOOPBACK", "ServerProcess", "SlowLink", "free_port", "functions_job",
           "make_fingerprint", "make_manifest", "raw_http", "sha256"]

TESTS = Path(__file__).resolve().parent



class ServerProcess(LocalServer):
    """A LocalServer the tests can look inside, whichever blob store it uses."""

    backend = "sqlite+fs"
    s3_endpoint: str | None = None
    s3_bucket: str | None = None

    def cli(self, *args: str) -> str:
        """Run a `megacache-server` subcommand against this server's storage settings."""
        import os
        import subprocess
        import sys

        cmd = [sys.executable, "-m", "megacache_server", *args, *self.extra_args]
        if "MEGACACHE_DATA_DIR" not in self.env:
            cmd += ["--data-dir", str(self.data_dir)]
        out = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True,
                             text=True, timeout=60)
        if out.returncode != 0:
            raise AssertionError(f"{args} failed: {out.stderr}")
        return out.stdout.strip()

    def token(self, scopes: str, namespace: str = "default", name: str = "test") -> str:
        """A new token of this server, made by `megacache-server token create`'s own code
        run in this process: a subprocess per token costs an interpreter start (~1.7 s),
        and the fast tier makes hundreds (the command itself is tested in
        test_server_cli.py)."""
        import contextlib
        import io
        import os

        from megacache_server import cli

        args = ["token", "create", "--name", name, "--scopes", scopes, "--namespace",
                namespace, *self.extra_args]
        if "MEGACACHE_DATA_DIR" not in self.env:
            args += ["--data-dir", str(self.data_dir)]
        out, err = io.StringIO(), io.StringIO()
        saved = dict(os.environ)
        try:
            os.environ.update(self.env)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(args)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if code != 0:
            raise AssertionError(f"token create failed ({code}): {err.getvalue()}")
        return out.getvalue().strip()

    def _s3(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")

    def temp_files(self) -> list[str]:
        """Uploads in flight: fs temp files, or S3 multipart uploads not completed."""
        if self.s3_endpoint:
            uploads = self._s3().list_multipart_uploads(Bucket=self.s3_bucket)
            return sorted(u["Key"] for u in uploads.get("Uploads", []))
        return sorted(p.name for p in (self.data_dir / "tmp").glob("*"))

    def blob_names(self) -> list[str]:
        """Digests of the blobs visible in the store (under `cas/`: not those quarantined)."""
        if self.s3_endpoint:
            listing = self._s3().list_objects_v2(Bucket=self.s3_bucket, Prefix="cas/")
            return sorted(o["Key"].rsplit("/", 1)[-1] for o in listing.get("Contents", []))
        return sorted(p.name for p in (self.data_dir / "cas").glob("*/*"))

    def read_stored(self, digest: str) -> bytes:
        if self.s3_endpoint:
            obj = self._s3().get_object(Bucket=self.s3_bucket, Key=self._key(digest))
            return bytes(obj["Body"].read())
        return self._path(digest).read_bytes()

    def write_stored(self, digest: str, data: bytes) -> None:
        """Put bytes under a blob's name behind the server's back (rot, or an orphan)."""
        if self.s3_endpoint:
            self._s3().put_object(Bucket=self.s3_bucket, Key=self._key(digest), Body=data)
            return
        self._path(digest).parent.mkdir(exist_ok=True)
        self._path(digest).write_bytes(data)

    def drop_stored(self, digest: str) -> None:
        """Lose a blob behind the server's back."""
        if self.s3_endpoint:
            self._s3().delete_object(Bucket=self.s3_bucket, Key=self._key(digest))
            return
        self._path(digest).unlink()

    @staticmethod
    def _key(digest: str) -> str:
        return f"cas/{digest[:2]}/{digest}"

    def _path(self, digest: str) -> Path:
        return self.data_dir / self._key(digest)


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
        while not _complete(response):
            chunk = s.recv(65536)
            if not chunk:
                break
            response += chunk
    if not response:
        return 0, b""
    return int(response.split(b" ", 2)[1]), response


def _complete(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


def make_fingerprint(model: str = "mlp", code: str = "c0", **overrides: object) -> Fingerprint:
    base: dict[str, object] = {
        "model": model,
        "code": code,
        "env": {"torch": "2.13.0", "python": "3.11", "cuda": None},
        "hw": {"arch": "x86_64", "isa": "avx2", "cxx": "g++ 12.2.0"},
        "config": {"backend": "inductor", "mode": "default"},
    }
    base.update(overrides)
    return parse(Fingerprint, base)


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


class ForwardingProxy:
    """A loopback HTTP proxy to a real server, for tests where the server lies or lags:
    each request goes to `upstream` at `rewrite(path)` (the attacker's choice), after
    `hold(method, path)` seconds (a slow link for that request), unless `answer(method, path)`
    gives the proxy's own answer (status, headers, body). Bodies and headers pass through;
    hop-by-hop headers do not. `seen` and `headers` record what each request carried."""

    HOP_BY_HOP = ("host", "content-length", "connection", "transfer-encoding",
                  "content-encoding")

    def __init__(self, upstream: str, rewrite: Callable[[str], str] = lambda path: path,
                 hold: Callable[[str, str], float] = lambda method, path: 0.0,
                 answer: Callable[[str, str], tuple[int, dict[str, str], bytes] | None]
                 = lambda method, path: None) -> None:
        drop = self.HOP_BY_HOP
        self.seen: list[tuple[str, str, bytes]] = []  # method, path, body: what was sent
        self.headers: list[dict[str, str]] = []  # each request's headers, names lowercased
        seen, headers = self.seen, self.headers

        class Forward(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                time.sleep(hold(self.command, self.path))
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                seen.append((self.command, self.path, body))
                headers.append({k.lower(): v for k, v in self.headers.items()})
                own = answer(self.command, self.path)  # the proxy answers this one itself
                if own is not None:
                    self.send_response(own[0])
                    for k, v in {**own[1], "content-length": str(len(own[2]))}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(own[2])
                    return
                r = httpx.request(self.command, upstream + rewrite(self.path),
                                  headers={k: v for k, v in self.headers.items()
                                           if k.lower() not in drop},
                                  content=body or None, timeout=60)
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in drop:
                        self.send_header(k, v)
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(r.content)

            do_GET = do_HEAD = do_POST = do_PUT = _forward

            def log_message(self, *_: object) -> None:
                return

        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Forward)
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ForwardingProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class SlowLink:
    """A loopback TCP forwarder to a real server whose uplink crawls: what a client sends
    goes on at `rate` bytes/s, answers come back at full speed. When either side closes,
    both connections close, as they would when a process on a slow link dies."""

    def __init__(self, upstream_port: int, rate: int) -> None:
        self.upstream_port, self.rate = upstream_port, rate
        self.listener = socket.create_server((LOOPBACK, 0))
        self.url = f"http://{LOOPBACK}:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection((LOOPBACK, self.upstream_port))
            for src, dst, rate in ((client, upstream, self.rate), (upstream, client, 0)):
                threading.Thread(target=self._pump, args=(src, dst, rate), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, rate: int) -> None:
        try:
            while data := src.recv(16384):
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def functions_job(machine: Machine, gxx: GxxCounter, url: str, functions: str,
                  precompile: str = "0", env: dict[str, str] | None = None) -> JobRun:
    """`tests/republish_job.py` on `machine`: compiles some of two small functions under one
    fingerprint (a real torch.compile, a second or so of g++), publishes, prints its run."""
    import sys

    run = run_job(machine, functions, runner=[sys.executable, str(TESTS / "republish_job.py")],
                  env={"MEGACACHE_URL": url, "MEGACACHE_PRECOMPILE": precompile,
                       **(env or {})}, gxx=gxx, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def _half_then_wait(data: bytes, started: threading.Barrier) -> Iterator[bytes]:
    """The body in two halves, the second only once every uploader has sent its first:
    all uploads are in flight at once, as N connections of a hostile tenant are."""
    yield data[: len(data) // 2]
    # another upload refused breaks the barrier: send the rest now
    with contextlib.suppress(threading.BrokenBarrierError):
        started.wait(timeout=30)
    yield data[len(data) // 2:]


def uploads_at_once(urls: list[str], headers: dict[str, str], n: int, size: int
                    ) -> tuple[list[int], list[bytes]]:
    """`n` uploads of `size` random bytes, all in flight at once, over fresh connections
    to each of `urls` in turn: their answers (507 for one the server refused before
    reading its body) and the bytes."""
    from concurrent.futures import ThreadPoolExecutor

    started = threading.Barrier(n)
    blobs = [os.urandom(size) for _ in range(n)]

    def upload(i: int) -> int:
        with httpx.Client(base_url=urls[i % len(urls)], headers=headers, timeout=60) as c:
            try:
                return c.put(f"/v1/cas/{sha256(blobs[i])}",
                             content=_half_then_wait(blobs[i], started),
                             headers={"content-length": str(size)}).status_code
            except httpx.HTTPError:  # refused before the body was read: the server closed
                started.abort()
                return 507

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(upload, range(n))), blobs


def ett_of(url: str, job: str, attempts: int | None = None, timeout: float = 15.0
           ) -> dict[str, Any]:
    """The server's split of `job` once it has `attempts` attempts (any number: None) and
    the last has ended (the end is sent at the trainer's exit, at most 2 s on)."""
    end = time.monotonic() + timeout
    found: dict[str, Any] = {}
    while time.monotonic() < end:
        r = httpx.get(f"{url}/v1/jobs/{job}/ett", timeout=30)
        if r.status_code == 200:
            found = r.json()
            rows = found.get("attempts", [])
            if rows and attempts in (None, len(rows)) and rows[-1].get("ended"):
                return found
        time.sleep(0.25)
    raise AssertionError(f"the server has no ended split of {job}: {found or r.text}")


def token_client(server: ServerProcess, scopes: str, namespace: str = "default"
                 ) -> httpx.Client:
    """An HTTP client of `server` holding a new token of `scopes` in `namespace`."""
    token = server.token(scopes, namespace=namespace, name=f"{namespace}-{scopes}")
    return httpx.Client(base_url=server.url, timeout=30,
                        headers={"authorization": f"Bearer {token}"})


def run(make_index: Callable[[], Index], body: Callable[[Index], Awaitable[None]]) -> None:
    """`body` on a fresh, opened index of the `make_index` fixture, closed after."""
    async def main() -> None:
        index = make_index()
        await index.open()
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(main())
