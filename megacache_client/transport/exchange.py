"""The one exchange every request to the megacache server goes through.

`Exchange` is the base of `RemoteCache` (`client.py`): it makes the HTTP client (on first
use, with the process's one TLS context and the reader's wall clock under every connection)
and runs each request through `_exchange`: its URL comes from the route table
(`wire.routes`), it is retried with jittered backoff or after the server's `Retry-After`
(`retry.py`), counted by a circuit breaker the node's ranks share, bounded by the step's
deadline and by a wall clock of its own, and its answer is read by the one reader
(`reader.py`: a size cap per endpoint, no encodings, no redirects but a blob's). The routes
themselves live in the parts by what they talk to (`entries.py`, `blobs.py`,
`reporting.py`), so these manners are written once, here, and each part reads as its calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from megacache_client.config import ClientConfig
from megacache_client.errors import TransportError
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
from megacache_client.transport.trust import Gate
from megacache_client.wire import headers as wire_headers
from megacache_client.wire.escape import escape_logs
from megacache_client.wire.routes import Route
from megacache_client.wire.signing import parse_origins
from megacache_client.wire.version import __version__

# Every log line of the client escapes the text it did not write (`wire.escape`): such
# text reaches the client through the transport, so the filter is in place before any does.
escape_logs(logging.getLogger("megacache"))

_Self = TypeVar("_Self", bound="Exchange")


@dataclass(frozen=True)
class Answer:
    """A response read whole by the reader: status, headers and the (capped) body."""

    status: int
    headers: httpx.Headers
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class Exchange:
    """The connection to one server and the one way a request is made over it. Raises
    TransportError; never hangs past its deadline, and never holds more of an answer in
    memory than its endpoint's cap."""

    def __init__(self, config: ClientConfig, breaker: CircuitBreaker | None = None,
                 deadline: Deadline | None = None, gate: Gate | None = None) -> None:
        self.config = config
        self.breaker = breaker or breaker_for(config.url, config.node_cache_dir,
                                              config.breaker_reset_s)
        self.deadline = deadline or Deadline(None)
        self.gate = gate or Gate(config)
        """Every entry is handed out through it (`entries.py`)."""
        self.redirects = RedirectPolicy(config.url, parse_origins(config.redirect_origins),
                                        config.verify_key)
        """Where a blob download may be sent (`blobs.py`); nothing else is redirected."""
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

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

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

    def _listing(self, route: Route, what: str, **kw: Any) -> Any:
        """A GET answered with a JSON listing (capped), decoded."""
        a = self._exchange(route, what, cap=reader.LISTING_JSON, **kw)
        self._expect(a, (200,), what)
        return a.json()


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


def _retryable(answer: Answer, what: str) -> RetryableStatus:
    return RetryableStatus(
        f"{what}: HTTP {answer.status} {reader.error_message(answer.body)}", answer.status,
        retry_after_s(answer.headers.get("retry-after")))
