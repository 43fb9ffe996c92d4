"""`/v1/jobs/{job}/progress` and `/v1/jobs/{job}/ett`: what a trainer's rank 0 reports of
its job's time, and the job's Effective Training Time split from it (`service.ett.intake`,
`service.ett.split`; docs/ett.md)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse

from megacache_client.wire.events import JOB_ID_PATTERN
from megacache_server.api.budget import budgeted
from megacache_server.api.deps import Reader, Writer
from megacache_server.api.validation import request_body, require_content_length
from megacache_server.errors import PayloadTooLarge, error_responses

router = APIRouter(prefix="/v1/jobs", tags=["jobs"],
                   responses=error_responses(401, 403, 422, 431, 503))
Job = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="the job id (per namespace)")]
MAX_PROGRESS_BYTES = 128 * 1024
"""A batch of MAX_RECORDS records is ~40 KiB of JSON; nothing larger is read."""


@router.post("/{job}/progress", status_code=202,
             responses=error_responses(400, 408, 411, 413, 429),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": {
                     "$ref": "#/components/schemas/ProgressBatch"}}}}})
async def post_progress(job: Job, request: Request, cache: Writer) -> JSONResponse:
    """Record a batch of one attempt's progress records in the token's namespace."""
    require_content_length(request.headers.get("content-length"), MAX_PROGRESS_BYTES,
                           "progress batch")
    raw = bytearray()
    async for chunk in request_body(request):
        raw += chunk
        if len(raw) > MAX_PROGRESS_BYTES:
            raise PayloadTooLarge(f"body is over {MAX_PROGRESS_BYTES} bytes",
                                  limit=MAX_PROGRESS_BYTES)
    n = await cache.add_progress(job, bytes(raw))
    return JSONResponse({"status": "recorded", "records": n}, status_code=202)


@router.get("/{job}/ett", responses=error_responses(404, 429))
@budgeted
async def get_ett(
    job: Job, cache: Reader,
    since: Annotated[float | None, Query(gt=0, le=400 * 86400, description=(
        "also the split within the last `since` seconds (`window`)"))] = None,
) -> dict[str, Any]:
    """The job's wall time split per attempt into training, startup, compile, checkpoint
    save and restore, lost progress, recovery and idle; ETT%; failures; checkpoint advice."""
    return await cache.job_ett(job, since_s=since)


trend_router = APIRouter(prefix="/v1/ett", tags=["jobs"], responses=error_responses(
    401, 403, 422, 431, 503))


@trend_router.get("/trend", responses=error_responses(429))
@budgeted
async def get_ett_trend(
    cache: Reader,
    days: Annotated[float, Query(gt=0, le=400, description="how far back")] = 30,
    period: Annotated[str, Query(description="day or hour (hourly: at most 8 days)")] = "day",
    model: Annotated[str | None, Query(min_length=1, max_length=256,
                                       description="one model only")] = None,
) -> JSONResponse:
    """The namespace's Effective Training Time per day or hour: ETT%, seconds by category,
    failures by cause, time to start and to recover (p50/p90), per namespace and model,
    and the jobs that lost the most (docs/ett.md). Sent as it is made (plain JSON, ~150 kB
    for a month of 50 models: FastAPI's encoder would take longer than making it)."""
    return JSONResponse(await cache.ett_trend(days=days, period=period, model=model))
