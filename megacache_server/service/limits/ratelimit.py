"""Rate limits per caller, shared by every worker and replica.

Each limit is a token bucket per token held in the index (`RateStore`), keyed by the token's
id: a caller's rate holds however its connections are spread over worker processes and
replicas (a bucket per process admitted N times the rate across N processes), and two
tokens of different namespaces that share a name never share, nor drain, one bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from megacache_server.errors import TooManyRequests
from megacache_server.service.security.auth import Principal
from megacache_server.store.index.base import RateStore


@dataclass(frozen=True)
class Limit:
    """`rate` requests per second with bursts of `burst`, per token (0 rate: no limit)."""

    kind: str  # names the buckets: `{kind}:{token id}`
    what: str  # what is counted, as a refusal says it
    rate: float
    burst: float


async def admit(index: RateStore, limit: Limit, principal: Principal) -> None:
    """Take one request of the caller's allowance, or 429 with when to retry."""
    if limit.rate <= 0:
        return
    wait = await index.take(f"{limit.kind}:{principal.caller_id}", limit.rate, limit.burst,
                            time.time())
    if wait > 0:
        raise TooManyRequests(
            f"more than {limit.rate:g} {limit.what}/s from {principal.name!r}; "
            f"retry in {wait:.1f}s", headers={"retry-after": str(max(1, round(wait)))})
