"""`/metrics` (Prometheus), `/v1/dashboard` (the numbers behind the page) and `/` (the page)."""

from __future__ import annotations

import time
from collections import Counter as Tally
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse, Response

from megacache_client.manifest import Manifest
from megacache_server.auth import Principal, require
from megacache_server.errors import error_responses
from megacache_server.observe import (
    CONTENT_TYPE_LATEST,
    render_cache_metrics,
    render_process_metrics,
)
from megacache_server.storage import Storage, get_storage

router = APIRouter(tags=["observability"])
StorageDep = Annotated[Storage, Depends(get_storage)]
ALL = 10**9


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}, **error_responses(503)})
async def metrics(storage: StorageDep) -> Response:
    """Prometheus metrics: HTTP traffic of every worker, plus cache numbers from the index."""
    budget = storage.settings.store_budget
    cache = render_cache_metrics(
        store_bytes=await storage.index.stored_bytes(),
        budget=int(budget) if budget is not None else None,
        entries=await storage.index.entry_count(),
        models=await storage.index.stats())
    return Response(render_process_metrics() + cache, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/dashboard", responses=error_responses(401, 403, 422, 503))
async def dashboard_data(
    storage: StorageDep,
    _: Annotated[Principal, Depends(require("read"))],
    hours: Annotated[float, Query(gt=0, le=24 * 366)] = 24 * 7,
) -> dict[str, Any]:
    """Everything the dashboard shows, computed once on the server: the page only draws it."""
    now = time.time()
    since = now - hours * 3600
    models = await storage.index.stats(since=since)
    events = await storage.index.events_since(since, limit=100_000)
    bucket = 3600 if hours <= 72 else 86400
    timeline: dict[int, dict[str, float]] = {}
    for e in events:
        start = int(e.created_at.timestamp() // bucket * bucket)
        slot = timeline.setdefault(start, {"runs": 0, "warm": 0, "saved_s": 0.0})
        slot["runs"] += 1
        slot["warm"] += e.outcome in ("hit", "fallback")
        slot["saved_s"] += e.saved_s
    misses = Tally((e.model, e.outcome, e.reason[:200]) for e in events
                   if e.outcome not in ("hit", "fallback"))
    entries = await storage.index.list_entries(model=None, env_digest=None, hw_digest=None,
                                               limit=ALL)
    sizes: list[dict[str, Any]] = []
    for entry in entries:
        m = Manifest.model_validate_json(entry.manifest_json)
        sizes.append({"key": entry.key, "model": m.fingerprint.model,
                      "bytes": sum(b.size for b in m.blobs), "pinned": entry.pinned,
                      "last_access": entry.last_access})
    sizes.sort(key=lambda s: -int(s["bytes"]))
    runs = sum(m.runs for m in models)
    warm = sum(m.outcomes["hit"] + m.outcomes["fallback"] for m in models if m.outcomes)
    saved = sum(m.saved_s for m in models)
    budget = storage.settings.store_budget
    return {
        "generated_at": now,
        "hours": hours,
        "bucket_s": bucket,
        "total": {"runs": runs, "warm": warm, "hit_rate": round(warm / runs, 4) if runs else 0,
                  "saved_s": round(saved, 3), "saved_hours": round(saved / 3600, 4)},
        "models": [{"model": m.model, "runs": m.runs, "outcomes": m.outcomes,
                    "hit_rate": round(m.hit_rate, 4), "saved_s": round(m.saved_s, 3)}
                   for m in models],
        "timeline": [{"start": k, **v} for k, v in sorted(timeline.items())],
        "top_misses": [{"model": model, "outcome": outcome, "reason": reason, "count": n}
                       for (model, outcome, reason), n in misses.most_common(10)],
        "largest_entries": sizes[:10],
        "store": {"bytes": await storage.index.stored_bytes(), "entries": len(entries),
                  "budget": int(budget) if budget is not None else None},
    }


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    """The dashboard: one static page, no build step, nothing fetched from the internet."""
    page = resources.files("megacache_server").joinpath("static/dashboard.html").read_text()
    return HTMLResponse(page)
