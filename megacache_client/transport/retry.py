"""The one retry loop every request goes through: backoff, `Retry-After`, breaker, deadline.

A request is an `attempt()` callable. It returns its result, raises `httpx.HTTPError`
(reset, timeout) or `RetryableStatus` (5xx, 429) to ask for another try, or raises anything
else to stop at once (a 404, a corrupt blob). A connection that cannot be made (refused,
unreachable) stops at once and opens the breaker for the node: the client's attempt ends
without a retry's backoff, and nothing is built for a server nobody can reach. Each try is counted
by the circuit breaker. A `Deadline` bounds the whole step the requests belong to, not one
request: waits are cut to what is left of it, and running out of it opens the breaker so
the node's other ranks stop waiting on the same dead server.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import TypeVar

import httpx

from megacache_client.errors import DeadlineExceeded, TransportError, exc_text
from megacache_client.transport.breaker import CircuitBreaker

T = TypeVar("T")

MAX_RETRY_AFTER_S = 300.0
"""The longest a server's `Retry-After` may hold the breaker open (or a publish waiting)."""
BYTES_PER_EXTRA_SECOND = 1024 * 1024
"""A download that keeps delivering earns time: one second of deadline per MiB received,
so a big bundle arriving at a useful rate is never cut off, and a trickle still is."""


class RetryableStatus(TransportError):
    """The server answered 5xx or 429: try again, after `retry_after` seconds if it said so."""

    def __init__(self, message: str, status: int, retry_after: float | None) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after


class Deadline:
    """A time budget for a whole step (the load, the report); None means no budget."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._end = math.inf if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def credit(self, received: int) -> None:
        """Bytes arrived: the server is working, give the step time in proportion."""
        self._end += received / BYTES_PER_EXTRA_SECOND

    def cap(self, seconds: float) -> float:
        """`seconds`, cut to what is left of the budget (for timeouts and waits)."""
        return max(0.001, min(seconds, self.remaining()))


def retryable(status: int) -> bool:
    return status >= 500 or status == 429


def retry_after_s(value: str | None) -> float | None:
    """`Retry-After` as seconds: a number of seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def backoff_s(attempt: int) -> float:
    """Jittered exponential backoff: 0.2 s, 0.4 s, 0.8 s ... capped at 4 s."""
    return min(4.0, 0.2 * 2**attempt) * (0.5 + random.random())


def retrying(attempt: Callable[[], T], *, what: str, retries: int, breaker: CircuitBreaker,
             deadline: Deadline) -> T:
    """Run `attempt` until it succeeds, `retries` more tries are spent, or time runs out."""
    last: Exception | None = None
    out_of_time = False
    for n in range(retries + 1):
        breaker.check()
        if deadline.expired():
            out_of_time = True
            break
        try:
            result = attempt()
        except httpx.ConnectError as exc:
            # refused or unreachable: nothing listens there now, and a retry a moment
            # later finds the same; the node's ranks stop asking until the breaker's reset
            breaker.trip()
            raise TransportError(f"{what}: {_describe(exc)}") from exc
        except (httpx.HTTPError, RetryableStatus) as exc:
            last = exc
            breaker.failure()
        else:
            breaker.success()
            return result
        if n == retries:
            break
        asked = last.retry_after if isinstance(last, RetryableStatus) else None
        wait = min(asked, MAX_RETRY_AFTER_S) if asked is not None else backoff_s(n)
        if wait >= deadline.remaining():
            out_of_time = True
            if asked is not None:  # busy for longer than we can wait: so are the other ranks
                breaker.trip(min(asked, MAX_RETRY_AFTER_S))
            break
        time.sleep(wait)
    if out_of_time or deadline.expired():
        # The server was asked and did not answer in time: mark it down for the node. A
        # budget spent before the first try (on the trainer's own set-up, say) says nothing
        # about the server, and must not mark it down for every rank of the node.
        if last is not None:
            breaker.trip()
        raise DeadlineExceeded(
            f"{what}: no usable answer within the {deadline.seconds:g}s load deadline "
            f"(last: {_describe(last)}); MEGACACHE_LOAD_DEADLINE_S sets it"
        ) from last
    if isinstance(last, TransportError):
        raise last
    raise TransportError(f"{what}: {_describe(last)}") from last


def _describe(exc: Exception | None) -> str:
    if exc is None:
        return "no attempt made"
    if isinstance(exc, TransportError):
        return str(exc)
    return exc_text(exc)
