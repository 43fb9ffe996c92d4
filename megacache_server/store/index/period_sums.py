"""Sums of rollup periods that a process keeps decoded between calls.

A week's dashboard on Redis adds up ~31 rollup hashes of ~1,600 fields each (200 models x
the counters): tens of milliseconds to fetch and decode, for numbers that, but for the
current hour and today, never change. Every period carries a generation (the number of
events counted into it, bumped in the same transaction as the rollup itself), so one MGET
says which periods changed since they were decoded. The sum of the settled periods (all
but the current hour and day) is kept too, keyed by their generations: a late event that
lands in an old hour bumps that hour's generation and the sum is made again, never served
stale.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from anyio import to_thread

Sums = dict[str, float]


@dataclass(frozen=True)
class Period:
    """One rollup to add: its storage key, its generation (None: no event counted since
    generations were kept, so never cached: it may hold events from an older server) and
    whether its time is over (every period but the current hour and day)."""

    key: str
    generation: int | None
    settled: bool


def add_up(parts: Sequence[Sums]) -> Sums:
    """Field-wise sum, in a new dict (cached parts are never changed)."""
    total: Sums = {}
    for part in parts:
        for name, value in part.items():
            total[name] = total.get(name, 0.0) + value
    return total


class PeriodSums:
    """Bounded caches of decoded periods and of settled spans, for one index."""

    def __init__(self, *, max_periods: int = 256, max_spans: int = 64) -> None:
        self._periods: OrderedDict[str, tuple[int, Sums]] = OrderedDict()
        self._spans: OrderedDict[tuple[tuple[str, int], ...], Sums] = OrderedDict()
        self.max_periods = max_periods
        self.max_spans = max_spans
        self.fetched: deque[str] = deque(maxlen=64)  # the last keys read that held something

    async def total(self, periods: Sequence[Period],
                    fetch: Callable[[list[str]], Awaitable[list[Sums]]]) -> Sums:
        """The sum of `periods`; `fetch` reads and decodes the ones not cached."""
        stable = tuple((p.key, p.generation) for p in periods
                       if p.settled and p.generation is not None)
        span = self._spans.get(stable)
        if span is not None:
            self._spans.move_to_end(stable)
        in_span = {key for key, _ in stable}
        wanted = [p for p in periods if span is None or p.key not in in_span]
        parts = await self._parts(wanted, fetch)
        if span is None:
            span = await to_thread.run_sync(add_up, [parts[k] for k, _ in stable])
            self._spans[stable] = span
            while len(self._spans) > self.max_spans:
                self._spans.popitem(last=False)
        rest = [parts[p.key] for p in wanted if p.key not in in_span]
        return await to_thread.run_sync(add_up, [span, *rest])

    async def _parts(self, periods: list[Period],
                     fetch: Callable[[list[str]], Awaitable[list[Sums]]]) -> dict[str, Sums]:
        parts: dict[str, Sums] = {}
        missing: list[Period] = []
        for p in periods:
            hit = self._periods.get(p.key)
            if hit is not None and p.generation is not None and hit[0] == p.generation:
                parts[p.key] = hit[1]
                self._periods.move_to_end(p.key)
            else:
                missing.append(p)
        if missing:
            for p, sums in zip(missing, await fetch([p.key for p in missing]), strict=True):
                parts[p.key] = sums
                if sums:
                    self.fetched.append(p.key)
                if p.generation is not None:
                    # The generation was read before the data: the data is at least that
                    # new, so a later event always shows as a changed generation.
                    self._periods[p.key] = (p.generation, sums)
                    self._periods.move_to_end(p.key)
            while len(self._periods) > self.max_periods:
                self._periods.popitem(last=False)
        return parts
