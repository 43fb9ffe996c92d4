"""`/metrics` (Prometheus), `/v1/dashboard` (the numbers behind the page) and `/` (the page)."""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse, Response

from megacache_server.api.budget import budgeted
from megacache_server.api.deps import Reader, tenant
from megacache_server.api.request_metrics import CONTENT_TYPE_LATEST, render_process_metrics
from megacache_server.errors import error_responses
from megacache_server.service.caching.tenant import TenantCache
from megacache_server.service.observability.metrics import cache_metrics

router = APIRouter(tags=["observability"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}},
                       **error_responses(401, 403, 429, 503)})
@budgeted
async def metrics(cache: Annotated[TenantCache, Depends(tenant("metrics"))]) -> Response:
    """Prometheus metrics: the cache's running totals of the caller's namespace, and for
    callers who may see the whole server (`Principal.sees_server`) the HTTP traffic of every
    worker.

    With auth on, scrape with a token: one with the `metrics` scope sees every namespace
    and the server's own figures, an `admin` token its namespace and the server's figures,
    any other token only its own namespace's series."""
    server = render_process_metrics() if cache.principal.sees_server else b""
    body = server + await cache_metrics(cache)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/dashboard", responses=error_responses(401, 403, 422, 429, 503))
@budgeted
async def dashboard_data(
    cache: Reader,
    hours: Annotated[float, Query(gt=0, le=24 * 366)] = 24 * 7,
) -> dict[str, Any]:
    """Everything the dashboard shows for the caller's namespace: the page only draws it."""
    return await cache.dashboard(hours=hours)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    """The dashboard: one static page, no build step, nothing fetched from the internet."""
    page = resources.files("megacache_server.api").joinpath("static/dashboard.html").read_text()
    return HTMLResponse(page)
