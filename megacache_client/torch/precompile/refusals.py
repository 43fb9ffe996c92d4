"""A producer's refusals of its own precompile artifacts, as its bundle's meta says them,
and for how long a consumer takes them on trust (#58).

A refusal spares the next machine that traces the same key a child check (seconds at its
exit), but it is a claim by whoever wrote the entry: honoured for ever and carried by every
republish, any writer of a namespace could deny precompiled Dynamo to every consumer for
good. So a refusal counts only (1) from a bundle the gate admitted, i.e. of an entry whose
writer the consumer trusts (its writers policy, as for entries), and (2) for
`REFUSAL_TTL_S` from when it was first made (`META_REFUSED_AT`): a republish carries the
time it was first made, never renews it; past it (or without a time: an older client's)
the consumer checks the artifact itself, and refuses it afresh only if its own check does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

META_REFUSED = "precompile_refused"
"""Keys of the producer's precompile artifacts its check refused on the artifact itself
(`verify.settled`): a consumer that traces one again leaves it out unchecked."""
META_REFUSED_AT = "precompile_refused_at"
"""When the refusals were first made (Unix seconds): they expire REFUSAL_TTL_S later."""
REFUSAL_TTL_S = 86400.0


def _made_at(meta: dict[str, str]) -> float | None:
    try:
        return float(meta[META_REFUSED_AT])
    except (KeyError, ValueError):
        return None


def _fresh(metas: Iterable[dict[str, str]], now: float | None) -> list[dict[str, str]]:
    now = time.time() if now is None else now
    return [m for m in metas if m.get(META_REFUSED)
            and (at := _made_at(m)) is not None and now - REFUSAL_TTL_S <= at <= now + 300]


def refused_by(metas: Iterable[dict[str, str]], now: float | None = None) -> frozenset[str]:
    """The precompile keys the producers of these (gate-admitted) bundles refused, those
    refusals younger than REFUSAL_TTL_S only."""
    return frozenset(k for meta in _fresh(metas, now)
                     for k in meta[META_REFUSED].split(",") if k)


def refused_since(metas: Iterable[dict[str, str]], now: float | None = None) -> float | None:
    """When the oldest refusal `refused_by` takes from these bundles was made (None: none):
    what a bundle that carries them on says, so carrying never renews them."""
    return min((at for m in _fresh(metas, now) if (at := _made_at(m)) is not None),
               default=None)


def refusal_meta(refused: frozenset[str] | set[str], joined: str,
                 since: float | None = None) -> dict[str, str]:
    """The meta entries naming `refused` (already `joined` to fit), made `since` (now)."""
    if not refused:
        return {}
    return {META_REFUSED: joined, META_REFUSED_AT: str(int(since or time.time()))}
