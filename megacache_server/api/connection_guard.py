"""uvicorn's httptools protocol with the limits a shared server needs while reading a request.

uvicorn hands a request to the app only once its whole header block is parsed, and its
parser accepts header blocks of any size: one connection sending a 150 MiB header line
would hold about as much memory and keep the event loop busy for tens of seconds. The
HeaderLimit middleware (431 with a JSON body) only sees what survived that. Here, as nginx
does, bytes are counted as they arrive:

- a header block over `max_header_size` + HEADER_SLACK bytes gets 431 and the connection
  is closed before the rest is read (the middleware gives the precise 431 below that);
- a connection must deliver a complete header block within `header_timeout_s` of
  connecting or of its first byte after a response: one that sends nothing, or drips
  bytes, is closed (408 if it had started a request);
- open connections are capped below the process's descriptor limit (raised to the hard
  limit at start-up): past the cap, the connection idle the longest (no request in
  flight) is closed to make room, so a flood of idle sockets cannot lock others out.

Bodies have their own idle timeout (`upload_idle_timeout_s`, in the routes).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from megacache_server.errors import error_body
from megacache_server.settings import Settings

log = logging.getLogger("megacache.server")

HEADER_SLACK = 16 * 1024
"""Room for the request line and separators above the headers' own bytes."""
FD_RESERVE = 128
"""Descriptors kept for the index, blob files, logs and sockets being accepted."""
_last_warned = 0.0


@functools.lru_cache(maxsize=1)
def _limits() -> tuple[int, float, int | None]:
    """(raw header byte cap, header timeout, configured connection cap) from MEGACACHE_*."""
    settings = Settings()
    raise_fd_limit()
    return (int(settings.max_header_size) + HEADER_SLACK, settings.header_timeout_s,
            settings.max_connections)


def connection_cap(configured: int | None) -> int:
    """Connections to keep open: below the descriptor limit in force now (read each time:
    an operator may lower it on a running process with prlimit), and the configured cap."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = 1 << 20 if soft == resource.RLIM_INFINITY else max(16, soft - FD_RESERVE)
    return cap if configured is None else min(cap, configured)


def raise_fd_limit(ceiling: int = 65536) -> int:
    """Raise the soft descriptor limit toward the hard one (as nginx's worker_rlimit_nofile
    would be set); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft) if soft != resource.RLIM_INFINITY else ceiling


def _raw_response(status: int, reason: str, code: str, message: str) -> bytes:
    body = json.dumps(error_body(status, code, message)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that bounds header bytes, header time and open connections."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_cap, self._header_timeout, self._configured_cap = _limits()
        self._in_headers = True  # reading a header block (or waiting for one)
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since = time.monotonic()
        self._served = 0  # requests whose header block completed on this connection

    # -- connection life ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()
        cap = connection_cap(self._configured_cap)
        if len(self.connections) > cap:
            self._make_room(cap)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _make_room(self, cap: int) -> None:
        """Close one idle connection (this one if none is idle), cheapest loss first.

        Closing a kept-alive connection races the client's next request on it (the client
        sees a reset), so sockets that never sent a byte go first, then half-sent header
        blocks, and only then kept-alive ones; the oldest of the first tier found.
        """
        idle = [c for c in self.connections
                if isinstance(c, BoundedHttpToolsProtocol) and c is not self and c._idle()]
        victim = min(idle, key=lambda c: (c._shed_tier(), c._idle_since)) if idle else self
        global _last_warned
        if time.monotonic() - _last_warned > 10:  # a flood must not flood the log too
            _last_warned = time.monotonic()
            log.warning("%d connections open (cap %d): closing one idle for %.1fs",
                        len(self.connections), cap,
                        time.monotonic() - victim._idle_since)
        victim.connections.discard(victim)
        victim.transport.close()

    def _shed_tier(self) -> int:
        """0: never sent a byte; 1: in the middle of a header block; 2: kept alive."""
        if self._header_bytes:
            return 1
        return 2 if self._served else 0

    def _idle(self) -> bool:
        """No request in flight: waiting for (or reading) a header block."""
        return self._in_headers and (self.cycle is None or self.cycle.response_complete) \
            and not self.transport.is_closing()

    # -- reading --------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._in_headers:
            if self._header_timer is None:  # first bytes of a request on a kept-alive socket
                self._arm_header_timer()
            self._header_bytes += len(data)
        super().data_received(data)  # one read (<= 256 KiB) at most past the cap
        # still in the header block after this read: every byte of it was header bytes
        # (on_headers_complete resets the count when the block ends inside a read)
        if self._in_headers and self._header_bytes > self._header_cap \
                and not self.transport.is_closing():
            self._refuse(431, "Request Header Fields Too Large", "headers_too_large",
                         f"request headers are over {self._header_cap} bytes")

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_bytes = 0
        self._served += 1
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers = True  # what follows on this connection is the next request

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        super().on_response_complete()

    # -- header timer ---------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self._header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self._in_headers or self.transport.is_closing():
            return
        if self._header_bytes:
            self._refuse(408, "Request Timeout", "header_timeout",
                         f"request headers not complete within {self._header_timeout:g}s")
        else:  # a socket that never started a request: nothing to answer
            self.transport.close()

    def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
        self._disarm_header_timer()
        self._unset_keepalive_if_required()
        self.transport.write(_raw_response(status, reason, code, message))
        self.transport.close()
        self.parser = None  # type: ignore[assignment]

