"""FastAPI dependencies: the caller, authenticated, as the cache bound to it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request

from megacache_server.service.caching.cache import Cache
from megacache_server.service.caching.tenant import TenantCache
from megacache_server.service.security.auth import Scope


def cache_of(request: Request) -> Cache:
    return request.app.state.cache  # type: ignore[no-any-return]


def tenant(scope: Scope) -> Callable[[Request], Awaitable[TenantCache]]:
    """The cache bound to the caller, who must hold `scope`. Async on purpose: FastAPI runs
    a synchronous dependency in its thread pool, a hop per request on the hottest paths."""

    async def dependency(request: Request) -> TenantCache:
        return await cache_of(request).authorized(request.headers.get("authorization", ""),
                                                  scope)

    return dependency


Reader = Annotated[TenantCache, Depends(tenant("read"))]
Writer = Annotated[TenantCache, Depends(tenant("write"))]
Admin = Annotated[TenantCache, Depends(tenant("admin"))]
