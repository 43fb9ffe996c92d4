"""The one reader every response goes through: a wall clock for the whole operation, a size
cap per endpoint, and no body the client did not ask for.

A read timeout bounds one `recv`, not a response: a server (or proxy) that declares a large
`Content-Length` and then drips one byte every 2 s satisfies every read timeout and held a
trainer for 90 s against a 3 s load deadline; an endless chunked body grew the client to
2 GB. So:

- **Wall clock.** Every connect, send and `recv` of a request is cut to what is left of the
  operation's clocks (`operation(...)`, a context variable the network layer reads), so no
  response, however slowly it arrives, outlives its operation by more than one scheduler
  tick. The network layer is httpcore's own, wrapped (`WallClockBackend`).
- **Size caps.** A JSON answer is read into memory only up to its endpoint's cap (kilobytes
  to a few MiB); a declared length over the cap is refused before a byte is read; a blob is
  streamed to disk and refused past its manifest's size.
- **Encodings.** The client asks for `identity`; a body in any other encoding (a
  decompression bomb is one request away) is refused unread.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx

from megacache_client.errors import TransportError
from megacache_client.transport.retry import Deadline
from megacache_client.wire.escape import escape

KiB, MiB = 1024, 1024 * 1024
SMALL_JSON = 64 * KiB
"""Claims, reports, whoami, errors: a few hundred bytes each."""
MANIFEST_JSON = 1 * MiB
"""One manifest: the server refuses to store one over its `max_manifest_size` (64 KiB by
default); a megabyte leaves room for any server setting, and no more."""
LISTING_JSON = 16 * MiB
"""A listing of up to 50 manifests, or the stats of a namespace."""

_CLOCKS: contextvars.ContextVar[tuple[Deadline, ...]] = contextvars.ContextVar(
    "megacache_operation_clocks", default=())


@contextlib.contextmanager
def operation(*clocks: Deadline) -> Iterator[None]:
    """Every network wait inside ends when the first of `clocks` runs out (they may be
    credited meanwhile: a download that keeps delivering earns time); nested operations
    keep the outer clocks too."""
    token = _CLOCKS.set(_CLOCKS.get() + clocks)
    try:
        yield
    finally:
        _CLOCKS.reset(token)


def _cut(timeout: float | None, what: str) -> float:
    left = min((clock.remaining() for clock in _CLOCKS.get()), default=math.inf)
    if left <= 0:
        raise _timeout_error(what)("the operation's deadline passed")
    return left if timeout is None else min(timeout, left)


def _timeout_error(what: str) -> type[Exception]:
    return {"read": httpcore.ReadTimeout, "write": httpcore.WriteTimeout}.get(
        what, httpcore.ConnectTimeout)


class _WallClockStream(httpcore.NetworkStream):
    """httpcore's stream with every wait cut to the operation's end."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _cut(timeout, "read"))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _cut(timeout, "write"))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _WallClockStream(self._inner.start_tls(ssl_context, server_hostname,
                                                      _cut(timeout, "connect")))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class WallClockBackend(httpcore.NetworkBackend):
    """httpcore's network backend whose connections obey `operation`."""

    def __init__(self, inner: httpcore.NetworkBackend | None = None) -> None:
        self._inner = inner or httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None
                    ) -> httpcore.NetworkStream:
        return _WallClockStream(self._inner.connect_tcp(
            host, port, _cut(timeout, "connect"), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _WallClockStream(self._inner.connect_unix_socket(
            path, _cut(timeout, "connect"), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def install_wall_clock(client: httpx.Client) -> httpx.Client:
    """Put `WallClockBackend` under every connection pool of `client` (its own and those of
    any proxies the environment configured)."""
    transports = [client._transport, *(t for t in client._mounts.values() if t is not None)]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is None:
            raise RuntimeError("this httpcore has no pluggable network backend; the client "
                               "cannot bound its responses")
        if not isinstance(backend, WallClockBackend):
            pool._network_backend = WallClockBackend(backend)  # type: ignore[union-attr]
    return client


# -- reading bodies ---------------------------------------------------------------------
def refuse_encoded(response: httpx.Response) -> None:
    """An answer in a Content-Encoding the client did not ask for is refused unread
    (httpx decodes gzip, brotli and zstd whatever was asked, a whole chunk at a time: a
    hostile server's 32 KiB of zstd became gigabytes before any check could run)."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise TransportError(
            f"{response.request.method} {response.request.url.path}: the server answered "
            f"with Content-Encoding {encoding[:40]!r} though the client asked for identity; "
            "refusing to decode it", response.status_code)


def declared_length(response: httpx.Response) -> int | None:
    """The body's declared length; a malformed or negative one is a lie and refused."""
    text = response.headers.get("content-length")
    if text is None:
        return None
    if not text.strip().isdigit():
        raise TransportError(f"the server declared Content-Length {text[:40]!r}",
                             response.status_code)
    return int(text)


def read_capped(response: httpx.Response, cap: int, what: str) -> bytes:
    """The whole body of a streamed response, refused past `cap` bytes (declared or sent)."""
    refuse_encoded(response)
    if response.request.method == "HEAD" or response.status_code in (204, 304):
        return b""  # no body, whatever length it declares (HEAD: the resource's)
    declared = declared_length(response)
    if declared is not None and declared > cap:
        raise TransportError(f"{what}: the server declared a {declared}-byte answer, over "
                             f"the {cap}-byte limit for it", response.status_code)
    body = bytearray()
    for chunk in response.iter_raw():
        body += chunk
        if len(body) > cap:
            raise TransportError(f"{what}: the answer ran past the {cap}-byte limit for it",
                                 response.status_code)
    return bytes(body)


def error_message(body: bytes) -> str:
    """The server's error message from an error body already read (capped), for a log:
    escaped (`wire.escape`), so a server's newline or ESC never reaches a log raw."""
    try:
        import json

        return escape(json.loads(body)["error"]["message"], 300)
    except Exception:
        return escape(body[:200].decode("utf-8", "replace"), 300)
