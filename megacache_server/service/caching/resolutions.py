"""What a fleet agrees on: one resolution of a key per job attempt, one publisher per key.

Records are the caller's namespace's: another tenant's job of the same name is another
record, and the entry a resolution offers is only one this caller may read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass

from megacache_server.errors import Conflict, NotFound, Unprocessable
from megacache_server.service.caching.entries import Entries, parse_policy
from megacache_server.service.limits.quotas import Quotas
from megacache_server.service.security.auth import Principal
from megacache_server.store.index.base import (
    MAX_CLAIM_LEASE_S,
    MAX_RESOLUTION_TTL_S,
    Claim,
    Index,
    Resolution,
    StoredEntry,
)

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Job ids and claim holders: 1-128 of letters, digits, `.`, `_`, `-`, starting with a letter
or digit. No `/`, `:` or NUL (they name index records); `.` and `..` cannot match."""
MAX_ATTEMPT = 1_000_000
DEFAULT_RESOLUTION_TTL_S = 6 * 3600.0
"""How long a job attempt's resolution lives after the last rank asked, unless it says."""
DEFAULT_CLAIM_LEASE_S = 600.0
"""How long a publish claim lasts unless the claimant asks for another lease (or renews)."""


@dataclass(frozen=True)
class FallbackRule:
    """Which entry stands in for a missing key: the newest of `model` in `namespace` whose
    env and hw components have these digests (the client's own fallback rule), written by
    a writer the consumer's `writers` policy trusts when it sends one."""

    namespace: str
    model: str
    env: str
    hw: str
    writers: str | None = None


class Resolutions:
    """Resolutions of keys per job attempt, and publish claims per key."""

    def __init__(self, index: Index, entries: Entries, quotas: Quotas) -> None:
        self.index = index
        self.entries = entries
        self.quotas = quotas

    async def resolve(self, principal: Principal, key: str, *, job: str, attempt: int,
                      ttl_s: float = DEFAULT_RESOLUTION_TTL_S,
                      fallback: FallbackRule | None = None) -> Resolution:
        """What `key` means for this job attempt, the same for every rank: the first caller's
        answer (the entry this caller may see, or a miss) fixed for `ttl_s`, renewed as
        ranks ask.

        With a `fallback`, a key without an entry resolves to the newest entry of that
        namespace and model with the same env and hw: the fallback is chosen once, here,
        since ranks that each listed entries at their own moment could choose apart.

        Each token's resolves and claims are rate-limited (429), and a namespace holds at
        most `namespace_job_records` live ones (507): a record keeps a manifest's bytes for
        up to a day, and a read token can make up job ids."""
        await self.quotas.admit_job(principal)
        job = require_id(job, "job")
        if isinstance(attempt, bool) or not isinstance(attempt, int) \
                or not 0 <= attempt <= MAX_ATTEMPT:
            raise Unprocessable(f"attempt must be an integer from 0 to {MAX_ATTEMPT}",
                                code="invalid_attempt")
        ttl_s = require_seconds(ttl_s, MAX_RESOLUTION_TTL_S, "ttl_s")
        if fallback is not None:
            parse_policy(fallback.writers)  # 422 before anything is recorded
        try:
            candidate: StoredEntry | None = await self.entries.get_entry(principal, key)
        except NotFound:
            candidate = await self._fallback(principal, fallback) if fallback else None
        done = await self.index.resolve(principal.home, job, attempt, key, candidate, ttl_s,
                                        time.time(), max_records=self.quotas.job_records())
        if done.hit and await self.index.quarantined(list(done.digests)):
            # the attempt's entry named a blob since quarantined: a miss from now on (its
            # bytes are gone; the ranks that had it met the bad blob and compile)
            return dataclasses.replace(done, manifest_json=b"", etag="")
        return done

    async def resolution_provenance(self, done: Resolution) -> str:
        """Who wrote the version a job attempt resolved to, while that version is still the
        entry ("" once it was replaced or removed: a reader that needs a trusted writer
        then compiles)."""
        entry = await self.index.get(served_key(done), touch=False)
        return entry.provenance if entry is not None and entry.etag == done.etag else ""

    async def _fallback(self, principal: Principal, rule: FallbackRule) -> StoredEntry | None:
        newest = await self.entries.list_entries(principal, namespace=rule.namespace,
                                                 model=rule.model, env=rule.env, hw=rule.hw,
                                                 limit=1, writers=rule.writers)
        if not newest:
            return None
        try:
            return await self.entries.get_entry(principal, newest[0].key)
        except NotFound:  # evicted since it was listed
            return None

    async def claim(self, principal: Principal, key: str, *, holder: str,
                    lease_s: float = DEFAULT_CLAIM_LEASE_S) -> Claim:
        """Claim the publish of `key` in the caller's namespace for `lease_s` (claiming again
        renews it). 409 when another holder's lease is live: that one uploads. Limited as
        resolves are (429, 507)."""
        await self.quotas.admit_job(principal)
        holder = require_id(holder, "holder")
        lease_s = require_seconds(lease_s, MAX_CLAIM_LEASE_S, "lease_s")
        now = time.time()
        got = await self.index.claim(principal.home, key, holder, lease_s, now,
                                     max_records=self.quotas.job_records())
        if not got.granted:
            # now again: the holder's lease was granted at its own `now`, maybe after ours
            remaining = max(0.0, got.expires_at - time.time())
            raise Conflict(
                f"key {key} is being published by {got.holder!r} (lease runs out in "
                f"{remaining:.0f}s): skip the upload; add what the entry lacks once it is "
                "written", code="claim_held", holder=got.holder, expires_at=got.expires_at,
                remaining_s=round(remaining, 3))
        return got

    async def release_claim(self, principal: Principal, key: str, *, holder: str) -> None:
        """Give up `holder`'s claim (nothing to do if it lapsed); 409 if another holds it."""
        holder = require_id(holder, "holder")
        if not await self.index.release(principal.home, key, holder, time.time()):
            raise Conflict(f"the claim on key {key} is held by another holder, not "
                           f"{holder!r}", code="claim_not_held")


def require_id(value: object, what: str) -> str:
    """A job id or holder as ID_PATTERN allows, or 422 naming the rule (never echoing a
    huge or binary value back whole)."""
    if isinstance(value, str) and ID_PATTERN.fullmatch(value):
        return value
    shown = repr(value)[:80] if isinstance(value, str) else type(value).__name__
    raise Unprocessable(f"{what} {shown} is not valid: 1-128 of A-Z a-z 0-9 . _ -, starting "
                        "with a letter or digit", code=f"invalid_{what}")


def require_seconds(value: object, limit: float, what: str) -> float:
    """A finite number of seconds in (0, limit], or 422."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 < value <= limit:
        raise Unprocessable(f"{what} must be a number of seconds above 0 and at most "
                            f"{limit:g}", code=f"invalid_{what.removesuffix('_s')}",
                            limit=limit)
    return float(value)


def served_key(done: Resolution) -> str:
    """The key of the entry a resolution serves: the key asked, or, for a fallback, the
    stand-in's (its provenance is the stand-in's, not the missing key's)."""
    try:
        key = json.loads(done.manifest_json)["key"]
    except (ValueError, KeyError, TypeError):
        return done.key
    return key if isinstance(key, str) else done.key
