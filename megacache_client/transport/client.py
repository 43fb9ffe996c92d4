"""HTTP to the megacache server, with the manners a trainer needs.

Every request goes through one exchange (`RemoteCache._exchange`): its URL comes from the
route table (`wire.routes`), it is retried with jittered backoff or after the server's
`Retry-After` (`retry.py`), counted by a circuit breaker the node's ranks share, bounded by
the step's deadline and by a wall clock of its own, and its answer is read by the one
reader (`reader.py`: a size cap per endpoint, no encodings, no redirects but a blob's). A
blob download is a request like any other: a 5xx there is retried, and a broken stream
resumes with a Range request. Entries are handed out only through the gate
(`steps.verify.Gate`): signature, writer policy, key, rollback.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from megacache_client.transport import reader, redirects
from megacache_client.transport.breaker import CircuitBreaker, breaker_for
from megacache_client.transport.redirects import RedirectPolicy
from megacache_client.transport.retry import (
    Deadline,
    RetryableStatus,
    retry_after_s,
    retryable,
    retrying,
)
from megacache_client.transport.tls import tls_context
from megacache_client.transport.trust import Gate, ServedEntry
from megacache_client.wire import headers as wire_headers
from megacache_client.wire import routes
from megacache_client.wire.escape import escape, escape_logs
from megacache_client.wire.manifest import Manifest, component_digest, sha256_file
from megacache_client.wire.routes import Route
from megacache_client.wire.schema import SchemaError, parse
from megacache_client.wire.signing import blob_origin, parse_origins
from megacache_client.wire.text import as_text, escape_foreign
from megacache_client.wire.version import __version__

__all__ = ["CircuitBreaker", "CircuitOpenError", "CorruptBlobError", "DeadlineExceeded",
           "Deadline", "Progress", "RemoteCache", "ResolutionUnsupported", "ServedEntry",
           "TransportError", "UntrustedEntryError", "UntrustedWriterError", "breaker_for",
           "sha256_file"]

Progress = Callable[[int, int], None]
CHUNK = 1024 * 1024
# Every log line of the client escapes the text it did not write (`wire.escape`): such
# text reaches the client through this module, so the filter is in place before any does.
escape_logs(logging.getLogger("megacache"))


@dataclass(frozen=True)
class Answer:
    """A response read whole by the reader: status, headers and the (capped) body."""

    status: int
    headers: httpx.Headers
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class RemoteCache:
    """The v1 HTTP API as Python calls. Raises TransportError; never hangs past its
    deadline, and never holds more of an answer in memory than its endpoint's cap."""

    def __init__(self, config: ClientConfig, breaker: CircuitBreaker | None = None,
                 deadline: Deadline | None = None, gate: Gate | None = None) -> None:
        self.config = config
        self.breaker = breaker or breaker_for(config.url, config.node_cache_dir,
                                              config.breaker_reset_s)
        self.deadline = deadline or Deadline(None)
        self.gate = gate or Gate(config)
        self.redirects = RedirectPolicy(config.url, parse_origins(config.redirect_origins),
                                        config.verify_key)
        self._client: httpx.Client | None = None

    @property
    def _http(self) -> httpx.Client:
        """Made on first use (a rank that finds the breaker open makes none), with the
        process's one TLS context and the reader's wall clock under every connection."""
        if self._client is None:
            # identity only: blobs are compressed already, and a body a server or proxy
            # encodes anyway is refused before it is read (`reader.refuse_encoded`)
            headers = {"user-agent": f"megacache-client/{__version__}",
                       "accept-encoding": "identity", **producer_headers()}
            if self.config.token:
                headers["authorization"] = f"Bearer {self.config.token}"
            self._client = reader.install_wall_clock(httpx.Client(
                base_url=self.config.url,
                headers=headers,
                timeout=httpx.Timeout(self.config.read_timeout_s,
                                      connect=self.config.connect_timeout_s),
                follow_redirects=False,
                max_redirects=redirects.MAX_REDIRECTS,
                verify=tls_context(),
            ))
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> RemoteCache:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- the one exchange ---------------------------------------------------------------
    def _exchange(self, route: Route, what: str, *, cap: int = reader.SMALL_JSON,
                  params: dict[str, Any] | None = None, json: Any = None,
                  content: Any = None, headers: dict[str, str] | None = None,
                  clock: Deadline | None = None, **path: str) -> Answer:
        """One request through the retry loop, its answer read whole within `cap` bytes;
        a 4xx answer is returned as is. `clock` bounds each try besides the step's
        deadline (by default: the read timeout, for the whole answer, not per read).
        `content` may be a callable that makes the body afresh for each try (a stream)."""
        url = route.url(**path)

        def attempt() -> Answer:
            own = clock or Deadline(self.config.read_timeout_s)
            body_out = content() if callable(content) else content
            with reader.operation(self.deadline, own), self._http.stream(
                    route.method, url, params=params, json=json, content=body_out,
                    headers=headers, timeout=self._timeout()) as r:
                body = reader.read_capped(r, cap if r.status_code < 300 else
                                          reader.SMALL_JSON, what)
            answer = Answer(r.status_code, r.headers, body)
            if retryable(r.status_code):
                raise _retryable(answer, what)
            if 300 <= r.status_code < 400:
                raise TransportError(f"{what}: the server redirected ({r.status_code}) a "
                                     "request that is never redirected", r.status_code)
            return answer

        return self._retrying(attempt, what)

    def _retrying(self, attempt: Callable[[], Any], what: str) -> Any:
        return retrying(attempt, what=what, retries=self.config.retries,
                        breaker=self.breaker, deadline=self.deadline)

    def _timeout(self) -> httpx.Timeout:
        """The configured timeouts, cut to what is left of the step's deadline."""
        return httpx.Timeout(self.deadline.cap(self.config.read_timeout_s),
                             connect=self.deadline.cap(self.config.connect_timeout_s))

    @staticmethod
    def _expect(answer: Answer, ok: tuple[int, ...], what: str) -> None:
        if answer.status not in ok:
            raise TransportError(
                f"{what}: HTTP {answer.status} {reader.error_message(answer.body)}",
                answer.status)

    # -- entries ------------------------------------------------------------------------
    def get_entry(self, entry_key: str) -> ServedEntry | None:
        """The entry at `entry_key`, through the gate; None when there is none."""
        a = self._exchange(routes.GET_ENTRY, "get entry", cap=reader.MANIFEST_JSON,
                           key=entry_key)
        if a.status == 404:
            return None
        self._expect(a, (200,), "get entry")
        return self.gate.entry(entry_key, a.body, a.headers)

    def resolve_entry(self, entry_key: str, *, job: str, attempt: int, ttl_s: float,
                      fallback: dict[str, str] | None = None) -> ServedEntry | None:
        """The entry `entry_key` means for this job attempt (None: the attempt resolved it
        to a miss), the same for every rank whatever is published meanwhile.

        The answer may be another key's manifest only when a fallback rule was sent: the
        server chose the stand-in once for the attempt. The signature covers the key asked.
        """
        body: dict[str, Any] = {"job": job, "attempt": attempt, "ttl_s": ttl_s}
        if fallback is not None:
            body["fallback"] = fallback
        a = self._exchange(routes.RESOLVE_ENTRY, "resolve entry", cap=reader.MANIFEST_JSON,
                           json=body, key=entry_key)
        if a.status == 404 and a.headers.get(wire_headers.RESOLUTION) == "miss":
            return None
        if a.status in (404, 405):  # a server from before job resolutions
            raise ResolutionUnsupported(
                "the server does not resolve job attempts (an older version): each process "
                "decided alone", a.status)
        self._expect(a, (200,), "resolve entry")
        return self.gate.entry(entry_key, a.body, a.headers, fallback=fallback is not None,
                               job=(job, attempt))

    def claim(self, entry_key: str, *, holder: str, lease_s: float) -> str | None:
        """Claim the publish of `entry_key`: None when granted, else who holds it."""
        a = self._exchange(routes.CLAIM_PUBLISH, "claim publish", key=entry_key,
                           json={"holder": holder, "lease_s": lease_s})
        if a.status == 409:
            try:
                return escape(a.json()["error"]["holder"], 128)
            except (ValueError, KeyError, TypeError):
                return "another publisher"
        if a.status in (404, 405):  # a server from before claims: publish as before
            return None
        self._expect(a, (200,), "claim publish")
        return None

    def release_claim(self, entry_key: str, *, holder: str) -> None:
        a = self._exchange(routes.RELEASE_CLAIM, "release claim", key=entry_key,
                           params={"holder": holder})
        self._expect(a, (204, 404, 405, 409), "release claim")

    def reachable(self) -> bool:
        """Whether the server answers at all (`/healthz`, within this client's deadline):
        asked before work that only the server can use (a publish round's packs)."""
        try:
            return self._exchange(routes.HEALTHZ, "health check").status < 500
        except TransportError:
            return False

    def whoami(self) -> tuple[str, list[str]]:
        """This client's token name and scopes, as the server knows them."""
        a = self._exchange(routes.WHOAMI, "whoami")
        self._expect(a, (200,), "whoami")
        data = a.json()
        return escape(data["name"], 128), [escape(s, 64) for s in data["scopes"]][:16]

    def list_entries(self, *, model: str | None = None, env: dict[str, Any] | None = None,
                     hw: dict[str, Any] | None = None, limit: int = 20) -> list[Manifest]:
        """Entries of the namespace, newest first: nominations only. A listing is not
        signed; what is loaded is fetched again by key, through the gate."""
        params: dict[str, Any] = {"limit": limit}
        if model is not None:
            params["model"] = model
        if env is not None:
            params["env"] = component_digest(env)
        if hw is not None:
            params["hw"] = component_digest(hw)
        if self.config.trusted_writers:
            params["writers"] = self.config.trusted_writers
        entries: list[Manifest] = []
        for e in self._listing(routes.LIST_ENTRIES, "list entries", params=params)["entries"]:
            try:
                entries.append(parse(Manifest, e))
            except SchemaError as exc:  # stored before the text rule, or a hostile server
                logging.getLogger("megacache").warning(
                    "megacache: a listed entry is skipped: %s", escape_foreign(exc, 200))
        return entries

    def put_entry(self, manifest: Manifest, *, if_match: str | None = None,
                  if_none_match: str | None = None) -> str | None:
        """Write an entry; None when the precondition failed (someone else wrote first)."""
        headers = {"content-type": "application/json"}
        if if_match:
            headers["if-match"] = if_match
        if if_none_match:
            headers["if-none-match"] = if_none_match
        a = self._exchange(routes.PUT_ENTRY, "put entry", cap=reader.MANIFEST_JSON,
                           content=manifest.to_json(), headers=headers, key=manifest.key)
        if a.status == 412:
            return None
        self._expect(a, (200, 201), "put entry")
        return a.headers.get("etag", "")

    # -- blobs --------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        a = self._exchange(routes.HEAD_BLOB, "head blob", digest=digest)
        if a.status == 404:
            return False
        self._expect(a, (200,), "head blob")
        return True

    def upload_blob(self, path: Path, digest: str, progress: Progress | None = None) -> bool:
        """PUT a file's bytes under `digest`, streamed. True when the server did not have it.

        The upload's clock starts at the read timeout and earns a second per MiB sent, so
        a big blob at a useful rate is never cut off and a stalled one is."""
        size = path.stat().st_size
        clock = Deadline(self.config.read_timeout_s)
        a = self._exchange(routes.PUT_BLOB, "upload blob", clock=clock, digest=digest,
                           content=lambda: _file_chunks(path, progress, clock),
                           headers={"content-length": str(size),
                                    "content-type": "application/octet-stream"})
        self._expect(a, (200, 201), "upload blob")
        return a.status == 201

    def download_blob(self, digest: str, size: int, dest: Path,
                      progress: Progress | None = None) -> str:
        """Stream a blob into `dest`, resuming with Range after a broken connection; returns
        its sha256, computed while it was written.

        The file is checked against `digest` and `size` before this returns; on mismatch it
        is deleted and CorruptBlobError raised.
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._download_to(digest, size, dest, progress)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise

    def _download_to(self, digest: str, size: int, dest: Path,
                     progress: Progress | None) -> str:
        hashing = _Hashing()
        with open(dest, "wb") as f:
            self._retrying(lambda: self._stream_into(f, hashing, digest, size, progress),
                           f"download {digest[:12]}")
        actual_size = dest.stat().st_size
        actual = hashing.sha.hexdigest()
        if actual_size != size or actual != digest:
            # our words only: what the manifest promised, never the size or hash of what was
            # served (that is a foreign answer's, and the report and event go back out)
            wrong = (f"are not the manifest's {size} bytes" if actual_size != size
                     else "do not hash to its digest")
            message = f"blob {digest[:12]}… is corrupt: the bytes served {wrong}"
            raise CorruptBlobError(message, finding=Finding(
                "size" if actual_size != size else "digest", digest, detail=message))
        return actual

    def _stream_into(self, f: Any, hashing: _Hashing, digest: str, size: int,
                     progress: Progress | None) -> None:
        """One try: GET the blob (the rest of it, after a broken try) and append it to `f`
        (and to its hash), within its clock: the read timeout, earning a second per MiB."""
        done = f.tell()
        headers = {"range": f"bytes={done}-"} if done else {}
        what = f"download {digest[:12]}"
        clock = Deadline(self.config.read_timeout_s)
        with reader.operation(self.deadline, clock), redirects.follow(
                self._http, routes.GET_BLOB.url(digest=digest), headers, self._timeout(),
                self.redirects, what) as r:
            reader.refuse_encoded(r)
            if r.status_code == 200 and done:  # the server sent it whole: start over
                f.seek(0)
                f.truncate()
                hashing.sha = hashlib.sha256()
                done = 0
            elif r.status_code not in (200, 206):
                raise self._blob_error(r, what)
            declared = reader.declared_length(r)
            if declared is not None and done + declared > size:
                message = (f"blob {digest[:12]}… is declared longer than the manifest's "
                           f"{size} bytes")
                raise CorruptBlobError(message, finding=Finding("size", digest,
                                                                detail=message))
            for chunk in r.iter_raw(CHUNK):
                f.write(chunk)
                hashing.sha.update(chunk)
                done += len(chunk)
                self.deadline.credit(len(chunk))
                clock.credit(len(chunk))
                if done > size:
                    message = f"blob {digest[:12]}… is longer than {size} bytes"
                    raise CorruptBlobError(message, finding=Finding("size", digest,
                                                                    detail=message))
                if progress:
                    progress(done, size)
        f.flush()

    def _blob_error(self, r: httpx.Response, what: str) -> TransportError:
        """A blob answer that is not the blob: retryable or not, in our words. The server's
        own error message is kept (escaped); an answer from elsewhere (the presigned store)
        gives its status and host only, never its body."""
        if blob_origin(str(r.url)) == self.redirects.own:
            said = reader.error_message(reader.read_capped(r, reader.SMALL_JSON, what))
        else:  # the store's body is not even read
            said = f"from {escape(r.url.host, 100)}"
        if retryable(r.status_code):
            return RetryableStatus(f"{what}: HTTP {r.status_code} {said}", r.status_code,
                                   retry_after_s(r.headers.get("retry-after")))
        return TransportError(f"{what}: HTTP {r.status_code} {said}", r.status_code)

    # -- reports: bad bytes met ---------------------------------------------------------
    def report(self, finding: Finding, job: str | None = None) -> str:
        """Tell the server what this client met; returns its verdict ("ok", "quarantined",
        "counted", "withdrawn"). A blob is reported by digest (the server re-hashes it);
        torch failing on a bundle whose blobs all verified, by entry."""
        detail = as_text(finding.detail, 500)
        if finding.digest is not None:
            what = "report blob"
            a = self._exchange(routes.REPORT_BLOB, what, digest=finding.digest, json={
                "kind": finding.kind, "detail": detail, "entry_key": finding.entry_key})
        elif finding.entry_key is not None:
            what = "report entry"
            a = self._exchange(routes.REPORT_ENTRY, what, key=finding.entry_key, json={
                "kind": finding.kind, "detail": detail, "job": job})
        else:
            raise ValueError("a finding names a blob or an entry")
        self._expect(a, (200,), what)
        try:
            return escape(a.json()["verdict"], 32)
        except (ValueError, KeyError, TypeError):
            return "answered"

    # -- events and stats ---------------------------------------------------------------
    def post_event(self, event: dict[str, Any]) -> None:
        a = self._exchange(routes.POST_EVENTS, "post event", json=event)
        self._expect(a, (200, 201, 202), "post event")

    def post_progress(self, job: str, batch: bytes) -> None:
        """Send a job's progress (a `wire.progress.ProgressBatch` as JSON)."""
        a = self._exchange(routes.JOB_PROGRESS, "post progress", content=batch,
                           headers={"content-type": "application/json"}, job=job)
        self._expect(a, (200, 201, 202, 204), "post progress")

    def _listing(self, route: Route, what: str, **kw: Any) -> Any:
        """A GET answered with a JSON listing (capped), decoded."""
        a = self._exchange(route, what, cap=reader.LISTING_JSON, **kw)
        self._expect(a, (200,), what)
        return a.json()

    def stats(self) -> dict[str, Any]:
        return dict(self._listing(routes.STATS, "stats"))

    def jobs(self, *, limit: int = 50) -> list[dict[str, Any]]:
        """The namespace's jobs that reported last, each with its ETT split (`ett`)."""
        return list(self._listing(routes.JOBS, "jobs", params={"limit": limit})["jobs"])

    def job_ett(self, job: str) -> dict[str, Any]:
        """One job's Effective Training Time, per attempt (docs/ett.md)."""
        return dict(self._listing(routes.JOB_ETT, "job ETT", job=job))

    def ett_trend(self, **params: Any) -> dict[str, Any]:
        """The namespace's ETT per day or hour (`days`, `period`, `model`: docs/ett.md)."""
        return dict(self._listing(routes.ETT_TREND, "ETT trend", params=params))


def producer_headers() -> dict[str, str]:
    """Who is asking, as the server records it in the provenance of an entry this process
    writes: the client's version, and the job and attempt it belongs to (when launched in
    one; the server refuses malformed values, and `JobIdentity` reads only well-formed
    ones)."""
    job = JobIdentity.of_process()[0]
    found = {wire_headers.CLIENT_VERSION: __version__}
    if job.job_id is not None:
        found[wire_headers.JOB] = job.job_id
        found[wire_headers.ATTEMPT] = str(job.attempt)
    return found


def _file_chunks(path: Path, progress: Progress | None, clock: Deadline) -> Iterator[bytes]:
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            done += len(chunk)
            clock.credit(len(chunk))
            if progress:
                progress(done, total)
            yield chunk


class _Hashing:
    """The sha256 of a download so far (a try that starts over starts it over)."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()


class ResolutionUnsupported(TransportError):
    """The server has no job resolutions: the process decides alone."""


def _retryable(answer: Answer, what: str) -> RetryableStatus:
    return RetryableStatus(
        f"{what}: HTTP {answer.status} {reader.error_message(answer.body)}", answer.status,
        retry_after_s(answer.headers.get("retry-after")))
