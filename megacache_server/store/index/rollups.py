"""How events fold into rollups, the same on every index backend.

A run reported as an event adds its counters to a running total per (namespace, model),
to an hourly and a daily rollup, and (when it did not start warm) to a count of its miss
reason. Reports then add up whole days from the daily rollups and the ends of a window from
the hourly ones. What a tenant can invent (model names, reasons) is bounded per namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

from megacache_client.events import OUTCOMES, Event

COUNTERS = ("runs", *OUTCOMES, "compile_s", "saved_s", "bytes_down", "bytes_up", "tts_s",
            "tts_n")
"""What every rollup row adds up. Stored as floats: sums of bounded values never overflow."""


def event_counters(event: Event) -> dict[str, float]:
    """The increments one event adds to its rollup rows."""
    tts = getattr(event, "tts_s", None)
    counters = dict.fromkeys(COUNTERS, 0.0)
    counters.update(runs=1.0, compile_s=event.compile_s, saved_s=event.saved_s,
                    bytes_down=float(event.bytes_down), bytes_up=float(event.bytes_up))
    counters[event.outcome] = 1.0
    if tts is not None:
        counters.update(tts_s=float(tts), tts_n=1.0)
    return counters


HOUR = 3600
DAY = 24 * HOUR


def hour_of(ts: float) -> int:
    return int(ts // HOUR * HOUR)


@dataclass(frozen=True)
class Window:
    """Which rollups add up to the time since some moment: whole UTC days from the daily
    rollups, today included (its daily row is kept up to date as events arrive, so it holds
    exactly today's hours so far), and only the first, partial day from the hourly ones. A
    week of 200 models is ~6k rows to sum instead of ~34k, and a year ~73k instead of
    1.75M."""

    first_hour: int
    day_start: int
    day_end: int
    last_hour: int

    @property
    def hours(self) -> list[int]:
        """Hour starts summed from hourly rollups."""
        return [*range(self.first_hour, self.day_start, HOUR),
                *range(self.day_end, self.last_hour + 1, HOUR)]

    @property
    def days(self) -> list[int]:
        return list(range(self.day_start, self.day_end, DAY))


def window(since: float, now: float, *, days: bool = True, days_from: float = 0.0) -> Window:
    """The window from `since` to `now`; `days=False` keeps hourly resolution throughout,
    and no day before `days_from` (when daily rollups began) is read from them."""
    first, last = hour_of(since), hour_of(now)
    day_start = -(-max(first, int(days_from)) // DAY) * DAY
    day_end = last // DAY * DAY + DAY  # through today
    if not days or day_end <= day_start:
        return Window(first, first, first, last)
    return Window(first, day_start, day_end, last)


EVENT_BACKDATE_S = 30 * 24 * 3600

MAX_MODELS = 2000
"""Distinct model names one namespace's rollups keep; events of further models count under
OTHER_MODELS. A model name is whatever a client sends: without a bound, one tenant posting
a new name with every event (20/s is 1.7M a day) would grow everyone's `/metrics` (11
series per model), the admin's stats and dashboard without end."""
OTHER_MODELS = "(other models)"
MAX_REASONS = 1000
"""Distinct (model, outcome, reason) miss rows one namespace keeps per hour and per day;
further reasons count under OTHER_REASONS, so a flood of unique reasons costs the top-misses
table a bounded number of rows."""
OTHER_REASONS = "(other reasons)"


def event_hour(event: Event, now: float) -> int:
    """The hour an event counts in: when the client says it ran (a run reported late still
    lands in its hour), never in the future and never before the last 30 days."""
    at = event.created_at.timestamp()
    return hour_of(min(now, max(at, now - EVENT_BACKDATE_S)))
