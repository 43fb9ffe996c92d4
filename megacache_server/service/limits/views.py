"""Every read that can cost more than a lookup, budgeted by who asks: the one rule (#58).

A lookup reads one row. A view (a listing, a job's ETT, stats, the dashboard, the jobs
table, the trend, the quarantine, `/metrics`) reads many and builds an answer from them:
one tenant reading views in a loop from a few connections made another tenant's lookups
25-39x slower (a job of 64 attempts split on the event loop; a listing of a thousand 63 KB
manifests, 60 MiB an answer). So every view, whoever serves it, goes through `spend`:

- a rate per token (`MEGACACHE_VIEW_RATE` / `_VIEW_BURST`, kept in the index like every
  rate: `ratelimit`), 429 with `Retry-After` past it (auth off, one trusted caller: none);
- its namespace's lane (`split_cache.Lane`): one view of a namespace at a time, and at
  most `VIEW_SHARE` of the process's time; a flood queues behind itself;
- its work off the event loop (each view builds its answer in a worker thread);
- its answer bounded in bytes (`VIEW_ANSWER_BYTES`; a listing is cut there and says
  where to go on: `fitting`).

The routes declare a view with `api.budget.budgeted`, and tests/test_fair_reads.py walks
the route table: a GET route that is not a plain lookup and is not declared fails it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from megacache_server.service.ett.split_cache import Lane
from megacache_server.service.limits.ratelimit import Limit, admit
from megacache_server.service.security.auth import Principal
from megacache_server.settings import Settings
from megacache_server.store.index.base import RateStore

VIEW_ANSWER_BYTES = 4 * 1024 * 1024
"""The most a view answers at once: a listing past it is cut (`next_offset` says where the
next page starts); the client reads at most 16 MiB of a listing."""


class Views:
    """The budget every view of this process spends (see the module)."""

    def __init__(self, settings: Settings, index: RateStore,
                 lane: Callable[[str | None], Lane]) -> None:
        self.index = index
        self.lane = lane
        self.limit = Limit("views", "views (listings, ETT, stats, dashboards, metrics)",
                           settings.view_rate, settings.view_burst)

    @contextlib.asynccontextmanager
    async def spend(self, principal: Principal) -> AsyncIterator[None]:
        """Hold the caller's share while its view is made: its token's rate (auth off: no
        limit), then its namespace's lane."""
        if principal.token_id:
            await admit(self.index, self.limit, principal)
        async with self.lane(principal.namespace):
            yield


def fitting(pieces: Sequence[bytes], cap: int = VIEW_ANSWER_BYTES) -> int:
    """How many of `pieces`, from the first, fit in `cap` bytes (at least one: a page
    always moves on)."""
    used = 0
    for n, piece in enumerate(pieces):
        used += len(piece) + 1
        if used > cap and n > 0:
            return n
    return len(pieces)


FIRST_PAGE = 64
"""Entries a listing reads first; it reads more only while what it read stays under the
byte bound (a thousand 60 KB manifests read whole for a 4 MiB answer were 60 MB of index
reads an answer)."""


async def page(fetch: Callable[[int], Awaitable[list[bytes]]], offset: int, limit: int,
               cap: int = VIEW_ANSWER_BYTES) -> tuple[list[bytes], int | None]:
    """A page of a listing: the items after `offset`, at most `limit` of them and `cap`
    bytes, and the offset of the next page (None: none cut). `fetch(n)` gives the first
    `n` items; it is asked again for more (by the sizes read so far) only while the page
    is short of both bounds."""
    want = offset + limit
    n = min(want, offset + FIRST_PAGE)
    while True:
        got = await fetch(n)
        pieces = got[offset:]
        size = sum(len(p) + 1 for p in pieces)
        if len(got) < n or n >= want or size > cap:
            break
        each = size / len(pieces) if pieces else 1024
        n = min(want, max(2 * n, offset + int(cap / max(each, 1.0)) + 2))
    pieces = pieces[:limit]
    cut = fitting(pieces, cap)
    return pieces[:cut], offset + cut if cut < len(pieces) else None
