"""`budgeted`: how a route declares it serves a view (`service.limits.views`: rate per token, its
namespace's lane, a bounded answer). A GET route that is not a plain lookup must carry it:
tests/test_fair_reads.py walks the route table for `BUDGETED`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from megacache_server.service.caching.tenant import TenantCache

R = TypeVar("R")
BUDGETED = "__megacache_view__"
"""The mark a budgeted endpoint carries (what the route-table test reads)."""


def budgeted(endpoint: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """`endpoint` (whose caller's cache is its `cache` argument) run within the caller's
    view budget. FastAPI reads the wrapped signature (`functools.wraps`)."""

    @functools.wraps(endpoint)
    async def within_budget(*args: Any, **kwargs: Any) -> R:
        cache: TenantCache = kwargs["cache"]
        async with cache.viewing():
            return await endpoint(*args, **kwargs)

    # the signature with its annotations evaluated where the endpoint was written: FastAPI
    # releases that do not unwrap resolve string annotations in this module, which has
    # none of the route's names (`Response`)
    within_budget.__signature__ = inspect.signature(  # type: ignore[attr-defined]
        endpoint, eval_str=True)
    setattr(within_budget, BUDGETED, True)
    return within_budget
