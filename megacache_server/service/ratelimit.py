"""A token bucket per caller: what keeps one client from flooding the event log."""

from __future__ import annotations

import time


class RateLimiter:
    """`rate` per second with bursts of `burst`, per key, in this process.

    Each worker process and replica keeps its own buckets, so a fleet of N processes admits
    up to N times the rate: a bound on damage, not an exact quota.
    """

    MAX_KEYS = 10_000

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> float:
        """0 if one unit was available (and is now taken), else seconds until one is."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate
        if len(self._buckets) >= self.MAX_KEYS and key not in self._buckets:
            self._buckets.clear()
        self._buckets[key] = (tokens - 1, now)
        return 0.0
