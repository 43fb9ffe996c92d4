"""`/v1/events` and `/v1/stats`: what client runs saw, and what the cache saved."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from megacache_server.api.budget import budgeted
from megacache_server.api.deps import Reader, Writer
from megacache_server.api.validation import request_body, require_content_length
from megacache_server.errors import error_responses

router = APIRouter(prefix="/v1", tags=["events"],
                   responses=error_responses(401, 403, 422, 431, 503))
MAX_EVENT_BYTES = 16 * 1024


@router.post("/events", status_code=202, responses=error_responses(400, 408, 411, 413, 429),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": {"$ref": "#/components/schemas/Event"}}}}})
async def post_event(request: Request, cache: Writer) -> JSONResponse:
    """Record one client run in the token's namespace: outcome, seconds, bytes moved."""
    require_content_length(request.headers.get("content-length"), MAX_EVENT_BYTES, "event")
    body = b"".join([chunk async for chunk in request_body(request)])
    await cache.add_event(body)
    return JSONResponse({"status": "recorded"}, status_code=202)


@router.get("/stats", responses=error_responses(429))
@budgeted
async def get_stats(
    cache: Reader,
    since_hours: Annotated[float | None, Query(gt=0, le=24 * 3650)] = None,
) -> dict[str, Any]:
    """Per-model and total runs, outcomes, hit rate, compile time saved and time to start,
    for the caller's namespace."""
    return await cache.stats(since=time.time() - since_hours * 3600 if since_hours else None)


@router.get("/jobs", responses=error_responses(429))
@budgeted
async def get_jobs(
    cache: Reader,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> dict[str, Any]:
    """The caller's jobs that reported last, each with its latest attempts: the slowest
    rank's time to start (attempt 0) or recover, its outcome, compile seconds, ranks."""
    return {"jobs": await cache.jobs(limit=limit)}
