"""Checks on the shape of request inputs, shared by every route."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from megacache_client.wire.schema import shown_step
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

    A client that hangs up mid-body becomes a clean 400. One that stops sending for longer
    than `upload_idle_timeout_s`, or that after `min_upload_grace_s` averages less than
    `min_upload_rate` (a byte every few seconds keeps no idle timer from firing), gets a
    408: a slow upload cannot hold a temp file, a pending-quota reservation and a
    connection for as long as it likes.
    """
    settings = request.app.state.settings
    idle = settings.upload_idle_timeout_s
    floor, grace = float(settings.min_upload_rate), settings.min_upload_grace_s
    started, received = time.monotonic(), 0
    stream = request.stream().__aiter__()
    try:
        while True:
            wait, slow = idle, False
            if floor > 0:  # by `due`, more than `received` bytes must have come
                left = started + grace + received / floor - time.monotonic()
                if left < idle:
                    wait, slow = max(left, 0.0), True
            try:
                with anyio.fail_after(wait):
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not slow:
                    raise
                elapsed = time.monotonic() - started
                raise RequestTimeout(
                    f"upload too slow: {received} bytes in {elapsed:.0f}s, under the minimum "
                    f"of {floor:g} bytes/s after {grace:g}s", code="upload_too_slow") from None
            received += len(chunk)
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
        errors = [{"loc": [shown_step(s) for s in e["loc"]], "msg": e["msg"], "type": e["type"]}
                  for e in exc.errors()]
        raise Unprocessable("request body is invalid", code="invalid_request",
                            errors=errors) from None
