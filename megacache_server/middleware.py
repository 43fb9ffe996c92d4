"""ASGI middleware: checks that must run before any route, kept cheap (no Starlette layers)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send


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
                body = json.dumps({"error": {
                    "status": 431, "code": "headers_too_large",
                    "message": f"request headers are {size} bytes, over {self.limit}"}}).encode()
                await send({"type": "http.response.start", "status": 431, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
