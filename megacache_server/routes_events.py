"""`/v1/events` and `/v1/stats`: what client runs saw, and what the cache saved."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from megacache_client.events import Event
from megacache_server.auth import Principal, require
from megacache_server.errors import Unprocessable, error_responses
from megacache_server.storage import Storage, get_storage
from megacache_server.validation import request_body, require_content_length

router = APIRouter(prefix="/v1", tags=["events"],
                   responses=error_responses(401, 403, 422, 431, 503))
StorageDep = Annotated[Storage, Depends(get_storage)]
MAX_EVENT_BYTES = 16 * 1024


@router.post("/events", status_code=202, responses=error_responses(400, 408, 411, 413),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": {"$ref": "#/components/schemas/Event"}}}}})
async def post_event(request: Request, storage: StorageDep,
                     _: Annotated[Principal, Depends(require("write"))]) -> JSONResponse:
    """Record one client run: outcome, compile seconds, seconds saved, bytes moved."""
    require_content_length(request.headers.get("content-length"), MAX_EVENT_BYTES, "event")
    body = b"".join([chunk async for chunk in request_body(request)])
    try:
        event = Event.model_validate_json(body)
    except ValidationError as exc:
        raise Unprocessable("event does not match the schema", code="invalid_event",
                            errors=[{"loc": list(e["loc"]), "msg": e["msg"]}
                                    for e in exc.errors(include_url=False)]) from None
    await storage.index.add_event(event)
    return JSONResponse({"status": "recorded"}, status_code=202)


@router.get("/stats")
async def get_stats(
    storage: StorageDep,
    _: Annotated[Principal, Depends(require("read"))],
    since_hours: Annotated[float | None, Query(gt=0, le=24 * 3650)] = None,
) -> dict[str, Any]:
    """Per-model and total runs, outcomes, hit rate and compile time saved."""
    since = time.time() - since_hours * 3600 if since_hours else None
    models = await storage.index.stats(since=since)
    total = {"runs": 0, "warm": 0, "compile_s": 0.0, "saved_s": 0.0, "bytes_down": 0,
             "bytes_up": 0}
    rows = []
    for m in models:
        row = asdict(m) | {"hit_rate": round(m.hit_rate, 4)}
        rows.append(row)
        assert m.outcomes is not None
        total["runs"] += m.runs
        total["warm"] += m.outcomes["hit"] + m.outcomes["fallback"]
        for k in ("compile_s", "saved_s", "bytes_down", "bytes_up"):
            total[k] += getattr(m, k)
    total["hit_rate"] = round(total["warm"] / total["runs"], 4) if total["runs"] else 0.0
    total["saved_hours"] = round(total["saved_s"] / 3600, 4)
    return {"total": total, "models": rows}
