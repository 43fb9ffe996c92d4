"""Why attempts failed, and what each cause cost: summed over jobs and shown as rows.

An attempt's cause is what its end said, else what a later attempt learnt of it (a killed
attempt's lifeline, read on its node), else `lost`; the split (`split.py`) asks here for
each failed attempt, and the report, the metrics and the trend sum the causes of many.
"""

from __future__ import annotations

from typing import Any

from megacache_client.wire.progress import CAUSES
from megacache_server.store.index.progress import AttemptProgress


def add_causes(parts: Any) -> dict[str, tuple[int, float, float]]:
    """`by_cause` summed over jobs (or windows)."""
    out: dict[str, tuple[int, float, float]] = {}
    for part in parts:
        for cause, (n, lost, recovery) in part.items():
            m, l0, r0 = out.get(cause, (0, 0.0, 0.0))
            out[cause] = (m + n, l0 + lost, r0 + recovery)
    return out


def cause_rows(causes: dict[str, tuple[int, float, float]]) -> list[dict[str, Any]]:
    """`by_cause` as rows, in the order of `CAUSES`."""
    return [{"cause": c, "failures": causes[c][0], "unsaved_training_s": _r(causes[c][1]),
             "recovery_s": _r(causes[c][2])} for c in CAUSES if c in causes]


def cause_of(a: AttemptProgress, failed: bool) -> tuple[str | None, str | None]:
    """Why a failed attempt failed, and what names it: what its end said, else what a
    later attempt learnt of it (killed: its lifeline), else `lost`: no end record and
    nothing later from its node. Never a guess: `unknown` where nothing says."""
    if not failed:
        return None, None
    if a.end_reason == "failed" and a.end_cause:
        return a.end_cause, a.end_detail
    if a.failure is not None:
        return a.failure[0], a.failure[1]
    if a.end_reason == "failed":
        return "unknown", a.end_detail
    if a.end_reason is not None:
        return "unknown", f"it ended {a.end_reason}, and the job ran again"
    return "lost", "no end record and nothing later from its node"


def _r(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None
