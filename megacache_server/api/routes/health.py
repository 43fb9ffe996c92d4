"""`/healthz` and `/readyz`: whether the process is up, and whether it can serve and write."""

from __future__ import annotations

from fastapi import APIRouter, Request

from megacache_server import __version__
from megacache_server.api.deps import cache_of

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok", "version": __version__}


@router.get("/readyz", responses={503: {}, 507: {}})
async def readyz(request: Request) -> dict[str, str]:
    """Storage is reachable and can still write: 503/507 with the reason when not."""
    return await cache_of(request).ready()
