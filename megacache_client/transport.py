"""HTTP to the megacache server, with the manners a trainer needs.

Every call has connect and read timeouts, retries transient failures (connection errors,
5xx, 429) with jittered exponential backoff, and goes through a per-server circuit breaker:
after repeated failures the client stops calling a dead server for a while instead of
making every rank wait out its timeouts.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from megacache_client import __version__
from megacache_client.config import ClientConfig
from megacache_client.manifest import Manifest, component_digest
from megacache_client.signing import SIGNATURE_HEADER, SigningError, signature_valid

Progress = Callable[[int, int], None]
CHUNK = 1024 * 1024


class TransportError(Exception):
    """The server could not be used for this request; `status` is the HTTP status if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CircuitOpenError(TransportError):
    """The breaker is open: the server failed recently, so we do not wait on it again."""


class CorruptBlobError(TransportError):
    """Downloaded bytes do not hash to their address: never loaded, reported as invalid."""


class UntrustedEntryError(CorruptBlobError):
    """A manifest not made for what was asked (another key or fingerprint), or without a
    valid server signature when the client requires one."""


class CircuitBreaker:
    """Closed → open after `threshold` consecutive failures; half-open after `reset_s`."""

    def __init__(self, threshold: int = 3, reset_s: float = 30.0) -> None:
        self.threshold = threshold
        self.reset_s = reset_s
        self._failures = 0
        self._opened_at: float | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        with self._lock:
            if self._opened_at is None:
                return
            if time.monotonic() - self._opened_at >= self.reset_s:
                self._opened_at = None  # half-open: let one attempt through
                self._failures = self.threshold - 1
                return
            raise CircuitOpenError(
                f"server marked down after {self.threshold} failures; retrying in "
                f"{self.reset_s - (time.monotonic() - self._opened_at):.0f}s"
            )

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._failures >= self.threshold:
                self._opened_at = time.monotonic()

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None


_BREAKERS: dict[str, CircuitBreaker] = {}
_BREAKERS_LOCK = threading.Lock()


def breaker_for(url: str) -> CircuitBreaker:
    """One breaker per server per process, shared by every session and thread."""
    with _BREAKERS_LOCK:
        return _BREAKERS.setdefault(url, CircuitBreaker())


def _retriable(status: int) -> bool:
    return status >= 500 or status == 429


class RemoteCache:
    """The v1 HTTP API as Python calls. Raises TransportError; never hangs past its timeouts."""

    def __init__(self, config: ClientConfig, breaker: CircuitBreaker | None = None) -> None:
        self.config = config
        self.breaker = breaker or breaker_for(config.url)
        headers = {"user-agent": f"megacache-client/{__version__}"}
        if config.token:
            headers["authorization"] = f"Bearer {config.token}"
        self._http = httpx.Client(
            base_url=config.url,
            headers=headers,
            timeout=httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s),
            follow_redirects=True,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RemoteCache:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------
    def _call(self, fn: Callable[[], httpx.Response], what: str) -> httpx.Response:
        """Run one request with retries, backoff and the breaker; 4xx is returned as is."""
        attempts = self.config.retries + 1
        last: Exception | None = None
        for attempt in range(attempts):
            self.breaker.check()
            try:
                response = fn()
            except httpx.HTTPError as exc:
                last = exc
                self.breaker.failure()
            else:
                if not _retriable(response.status_code):
                    self.breaker.success()
                    return response
                last = TransportError(f"{what}: HTTP {response.status_code} "
                                      f"{_error_message(response)}", response.status_code)
                self.breaker.failure()
            if attempt + 1 < attempts:
                time.sleep(min(4.0, 0.2 * 2**attempt) * (0.5 + random.random()))
        if isinstance(last, TransportError):
            raise last
        raise TransportError(f"{what}: {type(last).__name__}: {last}") from last

    def _expect(self, response: httpx.Response, ok: tuple[int, ...], what: str) -> None:
        if response.status_code not in ok:
            raise TransportError(
                f"{what}: HTTP {response.status_code} {_error_message(response)}",
                response.status_code,
            )

    # -- entries ------------------------------------------------------------------------
    def get_entry(self, entry_key: str) -> tuple[Manifest, str] | None:
        r = self._call(lambda: self._http.get(f"/v1/ac/{entry_key}"), "get entry")
        if r.status_code == 404:
            return None
        self._expect(r, (200,), "get entry")
        self._check_signature(entry_key, r)
        manifest = Manifest.model_validate_json(r.content)
        if manifest.key != entry_key:
            raise UntrustedEntryError(f"asked for entry {entry_key[:12]}…, the server answered "
                                      f"with the manifest of {manifest.key[:12]}…: refusing it")
        return manifest, r.headers.get("etag", "")

    def _check_signature(self, entry_key: str, r: httpx.Response) -> None:
        """With a verify key, the manifest must be signed by the server for this key and the
        client's namespace (a signature of another entry, replayed here, does not verify)."""
        public_key = self.config.verify_key
        if not public_key:
            return
        try:
            ok = signature_valid(public_key, entry_key, self.config.namespace, r.content,
                                 r.headers.get(SIGNATURE_HEADER))
        except SigningError as exc:
            raise UntrustedEntryError(f"cannot verify entry {entry_key[:12]}…: {exc}") from None
        if not ok:
            raise UntrustedEntryError(f"entry {entry_key[:12]}… has no valid signature for "
                                      f"this key and namespace {self.config.namespace!r}: "
                                      "refusing to load a manifest the server did not sign")

    def list_entries(self, *, model: str | None = None, env: dict[str, Any] | None = None,
                     hw: dict[str, Any] | None = None, limit: int = 20) -> list[Manifest]:
        params: dict[str, Any] = {"limit": limit}
        if model is not None:
            params["model"] = model
        if env is not None:
            params["env"] = component_digest(env)
        if hw is not None:
            params["hw"] = component_digest(hw)
        r = self._call(lambda: self._http.get("/v1/ac", params=params), "list entries")
        self._expect(r, (200,), "list entries")
        return [Manifest.model_validate(e, strict=False) for e in r.json()["entries"]]

    def put_entry(self, manifest: Manifest, *, if_match: str | None = None,
                  if_none_match: str | None = None) -> str | None:
        """Write an entry; None when the precondition failed (someone else wrote first)."""
        headers = {"content-type": "application/json"}
        if if_match:
            headers["if-match"] = if_match
        if if_none_match:
            headers["if-none-match"] = if_none_match
        body = manifest.to_json()
        r = self._call(lambda: self._http.put(f"/v1/ac/{manifest.key}", content=body,
                                              headers=headers), "put entry")
        if r.status_code == 412:
            return None
        self._expect(r, (200, 201), "put entry")
        return r.headers.get("etag", "")

    # -- blobs --------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        r = self._call(lambda: self._http.head(f"/v1/cas/{digest}"), "head blob")
        if r.status_code == 404:
            return False
        self._expect(r, (200,), "head blob")
        return True

    def upload_blob(self, path: Path, digest: str, progress: Progress | None = None) -> bool:
        """PUT a file's bytes under `digest`, streamed. True when the server did not have it."""
        size = path.stat().st_size

        def send() -> httpx.Response:
            return self._http.put(f"/v1/cas/{digest}", content=_file_chunks(path, progress),
                                  headers={"content-length": str(size),
                                           "content-type": "application/octet-stream"})

        r = self._call(send, "upload blob")
        self._expect(r, (200, 201), "upload blob")
        return r.status_code == 201

    def download_blob(self, digest: str, size: int, dest: Path,
                      progress: Progress | None = None) -> None:
        """Stream a blob into `dest`, resuming with Range after a broken connection.

        The file is checked against `digest` and `size` before this returns; on mismatch it
        is deleted and CorruptBlobError raised.
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._download_to(digest, size, dest, progress)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise

    def _download_to(self, digest: str, size: int, dest: Path,
                     progress: Progress | None) -> None:
        attempts = self.config.retries + 1
        with open(dest, "wb") as f:
            for attempt in range(attempts):
                self.breaker.check()
                try:
                    self._stream_into(f, digest, size, progress)
                    self.breaker.success()
                    break
                except httpx.HTTPError as exc:
                    self.breaker.failure()
                    if attempt + 1 == attempts:
                        raise TransportError(f"download {digest[:12]}: {exc}") from exc
                    time.sleep(min(4.0, 0.2 * 2**attempt))
        actual_size = dest.stat().st_size
        actual = sha256_file(dest)
        if actual_size != size or actual != digest:
            raise CorruptBlobError(
                f"blob {digest[:12]}… is corrupt: got {actual_size} bytes hashing to "
                f"{actual[:12]}…, expected {size} bytes"
            )

    def _stream_into(self, f: Any, digest: str, size: int, progress: Progress | None) -> None:
        done = f.tell()
        headers = {"range": f"bytes={done}-"} if done else {}
        with self._http.stream("GET", f"/v1/cas/{digest}", headers=headers) as r:
            if r.status_code == 200 and done:
                f.seek(0)
                f.truncate()
                done = 0
            elif r.status_code not in (200, 206):
                r.read()
                raise TransportError(f"download {digest[:12]}: HTTP {r.status_code} "
                                     f"{_error_message(r)}", r.status_code)
            for chunk in r.iter_bytes(CHUNK):
                f.write(chunk)
                done += len(chunk)
                if done > size:
                    raise CorruptBlobError(f"blob {digest[:12]}… is longer than {size} bytes")
                if progress:
                    progress(done, size)
        f.flush()

    # -- events and stats ---------------------------------------------------------------
    def post_event(self, event: dict[str, Any]) -> None:
        r = self._call(lambda: self._http.post("/v1/events", json=event), "post event")
        self._expect(r, (200, 201, 202), "post event")

    def stats(self) -> dict[str, Any]:
        r = self._call(lambda: self._http.get("/v1/stats"), "stats")
        self._expect(r, (200,), "stats")
        return dict(r.json())


def _file_chunks(path: Path, progress: Progress | None) -> Iterator[bytes]:
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            done += len(chunk)
            if progress:
                progress(done, total)
            yield chunk


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in large chunks."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def _error_message(response: httpx.Response) -> str:
    try:
        response.read()
        return str(response.json()["error"]["message"])
    except Exception:
        return response.text[:200] if hasattr(response, "text") else ""
