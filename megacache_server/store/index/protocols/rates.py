"""Rates: token buckets shared by every worker and replica."""

from __future__ import annotations

from abc import ABC, abstractmethod


class RateStore(ABC):
    """Token buckets shared by every worker and replica: a caller's rate limit holds
    however its requests are spread over processes (a bucket per process would let a
    caller with N connections spread over N processes take N times its rate)."""

    @abstractmethod
    async def take(self, bucket: str, rate: float, burst: float, now: float) -> float:
        """Take one unit from `bucket`, which fills at `rate` per second up to `burst` (and
        is full when first used): 0.0 when taken, else the seconds until one is there
        (nothing is taken). Atomic across processes; a bucket unused for long may be
        forgotten (it would be full again)."""


def refill(bucket: tuple[float, float] | None, rate: float, burst: float,
           now: float) -> tuple[float, float]:
    """A token bucket's (tokens, at), or None for a new one (full), refilled to `now` and
    one unit taken if there is one: (tokens left, 0.0), else (tokens, seconds until one is
    there). One rule for the backends that compute it themselves."""
    tokens, at = bucket if bucket is not None else (burst, now)
    tokens = min(burst, tokens + max(0.0, now - at) * rate)
    if tokens < 1:
        return tokens, (1 - tokens) / rate
    return tokens - 1, 0.0
