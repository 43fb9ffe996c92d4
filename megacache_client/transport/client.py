"""HTTP to the megacache server, with the manners a trainer needs.

Every request has connect and read timeouts and goes through one retry loop (`retry.py`):
transient failures (connection errors, 5xx, 429) are retried with jittered backoff or after
the server's `Retry-After`, every try is counted by a circuit breaker the node's ranks
share, and an optional deadline bounds the whole step the requests belong to. A blob
download is a request like any other: a 5xx there is retried, and a broken stream resumes
with a Range request.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from megacache_client.config import ClientConfig
from megacache_client.errors import (
    CircuitOpenError,
    CorruptBlobError,
    DeadlineExceeded,
    Finding,
    TransportError,
    UntrustedEntryError,
    UntrustedWriterError,
)
from megacache_client.job import JobIdentity
from megacache_client.transport.breaker import CircuitBreaker, breaker_for
from megacache_client.transport.retry import (
    Deadline,
    RetryableStatus,
    retry_after_s,
    retryable,
    retrying,
)
from megacache_client.wire import headers as wire_headers
from megacache_client.wire import routes
from megacache_client.wire.manifest import Manifest, component_digest, sha256_file
from megacache_client.wire.schema import parse
from megacache_client.wire.signing import SigningError, signature_valid
from megacache_client.wire.version import __version__

__all__ = ["CircuitBreaker", "CircuitOpenError", "CorruptBlobError", "DeadlineExceeded",
           "Deadline", "Progress", "RemoteCache", "ResolutionUnsupported", "TransportError",
           "UntrustedEntryError", "UntrustedWriterError", "breaker_for", "sha256_file"]

Progress = Callable[[int, int], None]
CHUNK = 1024 * 1024


class RemoteCache:
    """The v1 HTTP API as Python calls. Raises TransportError; never hangs past its timeouts."""

    def __init__(self, config: ClientConfig, breaker: CircuitBreaker | None = None,
                 deadline: Deadline | None = None) -> None:
        self.config = config
        self.breaker = breaker or breaker_for(config.url, config.node_cache_dir,
                                              config.breaker_reset_s)
        self.deadline = deadline or Deadline(None)
        self._client: httpx.Client | None = None

    @property
    def _http(self) -> httpx.Client:
        """Made on first use (a rank that finds the breaker open makes none), with the
        process's one TLS context."""
        if self._client is None:
            # identity only: blobs are compressed already, and a body a server or proxy
            # encodes anyway is refused before it is read (`_refuse_encoded`)
            headers = {"user-agent": f"megacache-client/{__version__}",
                       "accept-encoding": "identity", **producer_headers()}
            if self.config.token:
                headers["authorization"] = f"Bearer {self.config.token}"
            self._client = httpx.Client(
                base_url=self.config.url,
                headers=headers,
                timeout=httpx.Timeout(self.config.read_timeout_s,
                                      connect=self.config.connect_timeout_s),
                follow_redirects=True,
                verify=tls_context(),
                event_hooks={"response": [_refuse_encoded]},
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> RemoteCache:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------
    def _call(self, fn: Callable[[httpx.Timeout], httpx.Response], what: str
              ) -> httpx.Response:
        """One request through the retry loop; a 4xx answer is returned as is."""

        def attempt() -> httpx.Response:
            response = fn(self._timeout())
            if retryable(response.status_code):
                raise _retryable(response, what)
            return response

        return self._retrying(attempt, what)

    def _retrying(self, attempt: Callable[[], Any], what: str) -> Any:
        return retrying(attempt, what=what, retries=self.config.retries,
                        breaker=self.breaker, deadline=self.deadline)

    def _timeout(self) -> httpx.Timeout:
        """The configured timeouts, cut to what is left of the step's deadline."""
        return httpx.Timeout(self.deadline.cap(self.config.read_timeout_s),
                             connect=self.deadline.cap(self.config.connect_timeout_s))

    def _expect(self, response: httpx.Response, ok: tuple[int, ...], what: str) -> None:
        if response.status_code not in ok:
            raise TransportError(
                f"{what}: HTTP {response.status_code} {_error_message(response)}",
                response.status_code,
            )

    # -- entries ------------------------------------------------------------------------
    def get_entry(self, entry_key: str) -> tuple[Manifest, str] | None:
        url = routes.GET_ENTRY.url(key=entry_key)
        r = self._call(lambda t: self._http.get(url, timeout=t), "get entry")
        if r.status_code == 404:
            return None
        self._expect(r, (200,), "get entry")
        self._check_signature(entry_key, r)
        self._check_writer(entry_key, r)
        manifest = Manifest.from_json(r.content)
        if manifest.key != entry_key:
            raise UntrustedEntryError(f"asked for entry {entry_key[:12]}…, the server answered "
                                      f"with the manifest of {manifest.key[:12]}…: refusing it")
        return manifest, r.headers.get("etag", "")

    def resolve_entry(self, entry_key: str, *, job: str, attempt: int, ttl_s: float,
                      fallback: dict[str, str] | None = None) -> tuple[Manifest, str] | None:
        """The entry `entry_key` means for this job attempt (None: the attempt resolved it
        to a miss), the same for every rank whatever is published meanwhile.

        The answer may be another key's manifest only when a fallback rule was sent: the
        server chose the stand-in once for the attempt. The signature covers the key asked.
        """
        body: dict[str, Any] = {"job": job, "attempt": attempt, "ttl_s": ttl_s}
        if fallback is not None:
            body["fallback"] = fallback
        r = self._call(lambda t: self._http.post(routes.RESOLVE_ENTRY.url(key=entry_key), json=body,
                                                 timeout=t), "resolve entry")
        if r.status_code == 404 and r.headers.get(wire_headers.RESOLUTION) == "miss":
            return None
        if r.status_code in (404, 405):  # a server from before job resolutions
            raise ResolutionUnsupported(
                "the server does not resolve job attempts (an older version): each process "
                "decided alone", r.status_code)
        self._expect(r, (200,), "resolve entry")
        self._check_signature(entry_key, r)
        self._check_writer(entry_key, r)
        manifest = Manifest.from_json(r.content)
        if manifest.key != entry_key and fallback is None:
            raise UntrustedEntryError(f"resolved entry {entry_key[:12]}…, the server answered "
                                      f"with the manifest of {manifest.key[:12]}…: refusing it")
        return manifest, r.headers.get("etag", "")

    def claim(self, entry_key: str, *, holder: str, lease_s: float) -> str | None:
        """Claim the publish of `entry_key`: None when granted, else who holds it."""
        r = self._call(lambda t: self._http.post(
            routes.CLAIM_PUBLISH.url(key=entry_key), json={"holder": holder, "lease_s": lease_s},
            timeout=t), "claim publish")
        if r.status_code == 409:
            try:
                return str(r.json()["error"]["holder"])[:128]
            except (ValueError, KeyError, TypeError):
                return "another publisher"
        if r.status_code in (404, 405):  # a server from before claims: publish as before
            return None
        self._expect(r, (200,), "claim publish")
        return None

    def release_claim(self, entry_key: str, *, holder: str) -> None:
        r = self._call(lambda t: self._http.delete(routes.RELEASE_CLAIM.url(key=entry_key),
                                                   params={"holder": holder}, timeout=t),
                       "release claim")
        self._expect(r, (204, 404, 405, 409), "release claim")

    def _check_writer(self, entry_key: str, r: httpx.Response) -> None:
        """With trusted writers configured, an entry anyone else wrote is refused unread
        (after the signature check: with a verify key, who wrote it is signed too)."""
        policy = self.config.writer_policy
        if policy is None:
            return
        why = policy.refusal(r.headers.get(wire_headers.PROVENANCE))
        if why:
            raise UntrustedWriterError(f"entry {entry_key[:12]}… {why}", entry_key,
                                       r.headers.get("etag", ""))

    def whoami(self) -> tuple[str, list[str]]:
        """This client's token name and scopes, as the server knows them."""
        r = self._call(lambda t: self._http.get(routes.WHOAMI.url(), timeout=t), "whoami")
        self._expect(r, (200,), "whoami")
        data = r.json()
        return str(data["name"])[:128], [str(s) for s in data["scopes"]][:16]

    def _check_signature(self, entry_key: str, r: httpx.Response) -> None:
        """With a verify key, the manifest must be signed by the server for this key and the
        client's namespace (a signature of another entry, replayed here, does not verify)."""
        public_key = self.config.verify_key
        if not public_key:
            return
        try:
            ok = signature_valid(public_key, entry_key, self.config.namespace, r.content,
                                 r.headers.get(wire_headers.SIGNATURE))
            provenance = r.headers.get(wire_headers.PROVENANCE)
            if ok and provenance:  # who wrote it, when said, must be what the server signed
                ok = signature_valid(public_key, entry_key, self.config.namespace, r.content,
                                     r.headers.get(wire_headers.PROVENANCE_SIGNATURE), provenance)
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
        url = routes.LIST_ENTRIES.url()
        r = self._call(lambda t: self._http.get(url, params=params, timeout=t), "list entries")
        self._expect(r, (200,), "list entries")
        return [parse(Manifest, e) for e in r.json()["entries"]]

    def put_entry(self, manifest: Manifest, *, if_match: str | None = None,
                  if_none_match: str | None = None) -> str | None:
        """Write an entry; None when the precondition failed (someone else wrote first)."""
        headers = {"content-type": "application/json"}
        if if_match:
            headers["if-match"] = if_match
        if if_none_match:
            headers["if-none-match"] = if_none_match
        body = manifest.to_json()
        url = routes.PUT_ENTRY.url(key=manifest.key)
        r = self._call(lambda t: self._http.put(url, content=body, headers=headers, timeout=t),
                       "put entry")
        if r.status_code == 412:
            return None
        self._expect(r, (200, 201), "put entry")
        return r.headers.get("etag", "")

    # -- blobs --------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        url = routes.HEAD_BLOB.url(digest=digest)
        r = self._call(lambda t: self._http.head(url, timeout=t), "head blob")
        if r.status_code == 404:
            return False
        self._expect(r, (200,), "head blob")
        return True

    def upload_blob(self, path: Path, digest: str, progress: Progress | None = None) -> bool:
        """PUT a file's bytes under `digest`, streamed. True when the server did not have it."""
        size = path.stat().st_size

        def send(timeout: httpx.Timeout) -> httpx.Response:
            return self._http.put(routes.PUT_BLOB.url(digest=digest),
                                  content=_file_chunks(path, progress),
                                  headers={"content-length": str(size),
                                           "content-type": "application/octet-stream"},
                                  timeout=timeout)

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
        with open(dest, "wb") as f:
            self._retrying(lambda: self._stream_into(f, digest, size, progress),
                           f"download {digest[:12]}")
        actual_size = dest.stat().st_size
        actual = sha256_file(dest)
        if actual_size != size or actual != digest:
            message = (f"blob {digest[:12]}… is corrupt: got {actual_size} bytes hashing to "
                       f"{actual[:12]}…, expected {size} bytes")
            raise CorruptBlobError(message, finding=Finding(
                "size" if actual_size != size else "digest", digest, detail=message))

    def _stream_into(self, f: Any, digest: str, size: int, progress: Progress | None) -> None:
        """One try: GET the blob (the rest of it, after a broken try) and append it to `f`."""
        done = f.tell()
        headers = {"range": f"bytes={done}-"} if done else {}
        what = f"download {digest[:12]}"
        with self._http.stream("GET", routes.GET_BLOB.url(digest=digest), headers=headers,
                               timeout=self._timeout()) as r:
            if r.status_code == 200 and done:
                f.seek(0)
                f.truncate()
                done = 0
            elif retryable(r.status_code):
                raise _retryable(r, what)
            elif r.status_code not in (200, 206):
                r.read()
                raise TransportError(f"{what}: HTTP {r.status_code} {_error_message(r)}",
                                     r.status_code)
            for chunk in r.iter_bytes(CHUNK):
                f.write(chunk)
                done += len(chunk)
                self.deadline.credit(len(chunk))
                if done > size:
                    message = f"blob {digest[:12]}… is longer than {size} bytes"
                    raise CorruptBlobError(message, finding=Finding("size", digest,
                                                                    detail=message))
                if progress:
                    progress(done, size)
        f.flush()

    # -- reports: bad bytes met ---------------------------------------------------------
    def report(self, finding: Finding, job: str | None = None) -> str:
        """Tell the server what this client met; returns its verdict ("ok", "quarantined",
        "counted", "withdrawn"). A blob is reported by digest (the server re-hashes it);
        torch failing on a bundle whose blobs all verified, by entry."""
        detail = finding.detail[:500]
        if finding.digest is not None:
            path, what = routes.REPORT_BLOB.url(digest=finding.digest), "report blob"
            body: dict[str, Any] = {"kind": finding.kind, "detail": detail,
                                    "entry_key": finding.entry_key}
        elif finding.entry_key is not None:
            path, what = routes.REPORT_ENTRY.url(key=finding.entry_key), "report entry"
            body = {"kind": finding.kind, "detail": detail, "job": job}
        else:
            raise ValueError("a finding names a blob or an entry")
        r = self._call(lambda t: self._http.post(path, json=body, timeout=t), what)
        self._expect(r, (200,), what)
        try:
            return str(r.json()["verdict"])[:32]
        except (ValueError, KeyError, TypeError):
            return "answered"

    # -- events and stats ---------------------------------------------------------------
    def post_event(self, event: dict[str, Any]) -> None:
        r = self._call(lambda t: self._http.post(routes.POST_EVENTS.url(), json=event, timeout=t),
                       "post event")
        self._expect(r, (200, 201, 202), "post event")

    def stats(self) -> dict[str, Any]:
        r = self._call(lambda t: self._http.get(routes.STATS.url(), timeout=t), "stats")
        self._expect(r, (200,), "stats")
        return dict(r.json())


_tls: ssl.SSLContext | None = None
_tls_lock = threading.Lock()


def tls_context() -> ssl.SSLContext:
    """The process's TLS context, made once. httpx makes a new one for every client, loading
    the whole CA bundle (35-130 ms measured here), and a trainer makes several clients
    (prefetch, load, publish, report), the load's on the way to the first step. It trusts
    what httpx would: SSL_CERT_FILE / SSL_CERT_DIR when set, else certifi's bundle (an
    https:// server, or the S3 store a blob download is redirected to)."""
    global _tls
    with _tls_lock:
        if _tls is None:
            cafile = os.environ.get("SSL_CERT_FILE") or None
            capath = os.environ.get("SSL_CERT_DIR") or None
            if cafile is None and capath is None:
                try:
                    import certifi  # httpx's own requirement

                    cafile = certifi.where()
                except ImportError:  # the system's trust store, then
                    pass
            _tls = ssl.create_default_context(cafile=cafile, capath=capath)
        return _tls


def producer_headers() -> dict[str, str]:
    """Who is asking, as the server records it in the provenance of an entry this process
    writes: the client's version, and the job and attempt it belongs to (when launched in
    one; the server refuses malformed values, and `JobIdentity` reads only well-formed ones)."""
    job = JobIdentity.of_process()[0]
    found = {wire_headers.CLIENT_VERSION: __version__}
    if job.job_id is not None:
        found[wire_headers.JOB] = job.job_id
        found[wire_headers.ATTEMPT] = str(job.attempt)
    return found


def _file_chunks(path: Path, progress: Progress | None) -> Iterator[bytes]:
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            done += len(chunk)
            if progress:
                progress(done, total)
            yield chunk


class ResolutionUnsupported(TransportError):
    """The server has no job resolutions: the process decides alone."""


def _refuse_encoded(response: httpx.Response) -> None:
    """An answer in a Content-Encoding the client did not ask for is refused unread.

    httpx decodes gzip, brotli and zstd bodies whatever was asked, a whole chunk at a time:
    a hostile server's 32 KiB of zstd became gigabytes in memory before any size, digest or
    signature check could run.
    """
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise TransportError(
            f"{response.request.method} {response.request.url.path}: the server answered "
            f"with Content-Encoding {encoding[:40]!r} though the client asked for identity; "
            "refusing to decode it", response.status_code)


def _retryable(response: httpx.Response, what: str) -> RetryableStatus:
    return RetryableStatus(f"{what}: HTTP {response.status_code} {_error_message(response)}",
                           response.status_code, retry_after_s(response.headers.get("retry-after")))


def _error_message(response: httpx.Response) -> str:
    try:
        response.read()
        return str(response.json()["error"]["message"])
    except Exception:
        return response.text[:200] if hasattr(response, "text") else ""
