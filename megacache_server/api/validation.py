"""Checks on the shape of request inputs, shared by every route."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from megacache_server.errors import (
    BadRequest,
    LengthRequired,
    PayloadTooLarge,
    RequestTimeout,
    Unprocessable,
)

M = TypeVar("M", bound=BaseModel)


def require_content_length(header: str | None, limit: int, what: str) -> int:
    """The declared body size, checked against `limit` before a byte of the body is read."""
    if header is None:
        raise LengthRequired(f"{what} upload needs a Content-Length header")
    try:
        length = int(header)
    except ValueError:
        raise BadRequest(f"Content-Length {header[:40]!r} is not a number") from None
    if length < 0:
        raise BadRequest("Content-Length is negative")
    if length > limit:
        raise PayloadTooLarge(
            f"{what} of {length} bytes is over the limit of {limit} bytes", limit=limit
        )
    return length


async def request_body(request: Request) -> AsyncIterator[bytes]:
    """The body as it streams in.

    A client that hangs up mid-body becomes a clean 400; one that stops sending for longer
    than `upload_idle_timeout_s` a 408, so a stalled upload cannot hold a temp file and a
    connection forever.
    """
    idle = request.app.state.settings.upload_idle_timeout_s
    stream = request.stream().__aiter__()
    try:
        while True:
            try:
                with anyio.fail_after(idle):
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            yield chunk
    except ClientDisconnect:
        raise BadRequest("client disconnected before the body was complete",
                         code="truncated") from None
    except TimeoutError:
        raise RequestTimeout(f"upload stalled: no bytes for {idle:g}s") from None


async def small_json_body(request: Request, model: type[M], limit: int) -> M:
    """A small JSON request body as `model`: read with a hard size limit (413 past it), so
    a client cannot make the server buffer more than a few KiB; 422 with pydantic's
    findings (never the offending values) when it does not fit the model."""
    raw = bytearray()
    async for chunk in request_body(request):
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLarge(f"body is over {limit} bytes", limit=limit)
    try:
        return model.model_validate_json(bytes(raw))
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                  for e in exc.errors()]
        raise Unprocessable("request body is invalid", code="invalid_request",
                            errors=errors) from None
