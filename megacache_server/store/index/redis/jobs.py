"""JobStore and ClaimStore on Redis: a hash per job attempt's resolution of a key and per
publish claim, each decided by one script (`resolve.lua`, `claim.lua`, `release.lua`) so
replicas agree, and `held`, the blobs live resolutions name by their latest expiry (GC).

Records carry their logical expiry (`expires_at`, the server's clock) and decide by it; the
keys also expire on their own a minute after it, so nothing accumulates when no GC runs.
A namespace's live records are counted in `jobrecs:{ns}` (record key -> expiry), which the
scripts trim and check before they make a new one.
"""

from __future__ import annotations

from typing import Any

from megacache_server.store.index.protocols import jobs
from megacache_server.store.index.protocols.entries import StoredEntry
from megacache_server.store.index.redis.connection import RedisConnection, text


class RedisJobs(RedisConnection, jobs.JobStore, jobs.ClaimStore):
    async def resolve(self, namespace: str, job: str, attempt: int, key: str,
                      candidate: StoredEntry | None, ttl_s: float, now: float, *,
                      max_records: int | None = None) -> jobs.Resolution:
        ttl_s = jobs.clamp_ttl(ttl_s, jobs.MAX_RESOLUTION_TTL_S)
        reply = _room(namespace, await self._run_script("resolve", [
            namespace, job, str(attempt), key, repr(now), repr(ttl_s),
            *((candidate.manifest_json, candidate.etag, candidate.namespace,
               ",".join(candidate.digests)) if candidate else ("", "", "", "")),
            _cap(max_records)]))
        manifest, etag, entry_ns, digests, resolved_at, expires_at = reply
        return jobs.Resolution(namespace, job, attempt, key,
                               manifest_json=bytes(manifest or b""),
                               etag=text(etag) or "", entry_namespace=text(entry_ns) or "",
                               digests=tuple(d for d in (text(digests) or "").split(",") if d),
                               resolved_at=float(resolved_at), expires_at=float(expires_at))

    async def held_blobs(self, digests: list[str], now: float) -> set[str]:
        async def op() -> set[str]:
            held: set[str] = set()
            for i in range(0, len(digests), 500):
                part = digests[i:i + 500]
                async with self.r.pipeline(transaction=False) as pipe:
                    for d in part:
                        pipe.zscore(self.keys.held(), d)
                    scores = await pipe.execute()
                held.update(d for d, s in zip(part, scores, strict=True)
                            if s is not None and float(s) > now)
            return held

        return await self._do(op)

    async def prune_jobs(self, now: float) -> int:
        """Resolutions and claims expire on their own; only the expired holds go here."""
        await self._do(lambda: self.r.zremrangebyscore(self.keys.held(), "-inf", now))
        return 0

    async def claim(self, namespace: str, key: str, holder: str, lease_s: float,
                    now: float, *, max_records: int | None = None) -> jobs.Claim:
        lease_s = jobs.clamp_ttl(lease_s, jobs.MAX_CLAIM_LEASE_S)
        granted, current, expires_at = _room(namespace, await self._run_script(
            "claim", [namespace, key, holder, repr(now), repr(lease_s), _cap(max_records)]))
        return jobs.Claim(bool(int(granted)), text(current) or "", float(expires_at))

    async def release(self, namespace: str, key: str, holder: str, now: float) -> bool:
        return bool(int(await self._run_script("release", [namespace, key, holder, repr(now)])))


def _cap(max_records: int | None) -> str:
    return "" if max_records is None else str(max_records)


def _room(namespace: str, reply: list[Any]) -> list[Any]:
    """A script's reply, or the refusal it stands for (`['!full', cap]`: nothing written)."""
    if len(reply) == 2 and text(reply[0]) == "!full":
        raise jobs.records_full(namespace, int(reply[1]))
    return reply
