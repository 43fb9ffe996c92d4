"""ASGI middleware: checks that must run before any route, kept cheap (no Starlette layers)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from megacache_server.errors import error_body


class HeaderLimit:
    """Refuse requests whose headers add up to more than `limit` bytes with a JSON 431.

    uvicorn's parser accepts very large header blocks; a cache server has no use for them,
    and each one costs memory per connection.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope["headers"])
            if size > self.limit:
                await _refuse(send, 431, "headers_too_large",
                              f"request headers are {size} bytes, over {self.limit}",
                              close=True)
                return
        await self.app(scope, receive, send)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class LocalOnly:
    """Without auth, serve only requests a browser on another site cannot make for us.

    With auth off anything that reaches the port is trusted, and a browser is the way a web
    page gets there: by DNS rebinding (a hostile name resolving to 127.0.0.1, so the
    request carries `Host: evil.example`) or by a cross-site simple request (a form POST,
    or `fetch` with `text/plain`, needs no CORS preflight). So: the `Host` must be a
    loopback name or one of `allowed_hosts` (421 otherwise), and a state-changing request
    whose `Origin` is another host or whose `Sec-Fetch-Site` says cross-/same-site gets
    403. Programs (the client, curl) send neither header and are unaffected.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.allowed = LOOPBACK_NAMES | {h.lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"").decode("latin-1")
            if host and not self.any_host and _hostname(host) not in self.allowed:
                await _refuse(send, 421, "host_not_allowed",
                              f"Host {host[:100]!r} is not served here: without auth only "
                              "loopback names and MEGACACHE_ALLOWED_HOSTS are accepted")
                return
            if scope["method"] not in SAFE_METHODS and _cross_site(headers, host):
                await _refuse(send, 403, "cross_site_request",
                              "cross-site requests may not change anything on a server "
                              "without auth")
                return
        await self.app(scope, receive, send)


def _hostname(host: str) -> str:
    """`Host` without its port, lowercased (`[::1]:8787` -> `[::1]`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _cross_site(headers: dict[bytes, bytes], host: str) -> bool:
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
    if site in ("cross-site", "same-site"):
        return True
    origin = headers.get(b"origin")
    if origin is None:
        return False
    authority = origin.decode("latin-1").partition("://")[2].rstrip("/").lower()
    return authority != host.strip().lower()  # `Origin: null` (sandboxed, file:) too


async def _refuse(send: Send, status: int, code: str, message: str,
                  close: bool = False) -> None:
    """A JSON error answered before any route runs."""
    body = json.dumps(error_body(status, code, message)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
