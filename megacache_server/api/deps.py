"""FastAPI dependencies: the caller, authenticated, as a metered view of the cache."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request

from megacache_server.service.auth import Scope, require
from megacache_server.service.cache import Cache
from megacache_server.service.metrics import Metered


def cache_of(request: Request) -> Cache:
    return request.app.state.cache  # type: ignore[no-any-return]


def tenant(scope: Scope) -> Callable[[Request], Awaitable[Metered]]:
    """The cache bound to the caller, who must hold `scope`. Async on purpose: FastAPI runs
    a synchronous dependency in its thread pool, a hop per request on the hottest paths."""
    authorize = require(scope)

    async def dependency(request: Request) -> Metered:
        principal = await authorize(request)
        return Metered(cache_of(request).bound(principal))

    return dependency


Reader = Annotated[Metered, Depends(tenant("read"))]
Writer = Annotated[Metered, Depends(tenant("write"))]
Admin = Annotated[Metered, Depends(tenant("admin"))]
