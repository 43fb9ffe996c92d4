"""TrustStore on Redis: a capped list of records, a hash of counts, a set of digests, a set
of reporters per entry version (expiring) and the `blob_verified` zset, longest ago first
(`keys.py` names them)."""

from __future__ import annotations

import json
from typing import Any

from megacache_server.store.index.protocols.blobs import BlobRecord
from megacache_server.store.index.protocols.trust import (
    MAX_QUARANTINE_RECORDS,
    QuarantineRecord,
    TrustStore,
    newest_touching,
)
from megacache_server.store.index.redis.connection import SCAN, RedisConnection, text

LOAD_REPORT_TTL_S = 7 * 86400
"""A version's load reports are forgotten this long after the last one."""


class RedisTrust(RedisConnection, TrustStore):
    async def entries_naming(self, digest: str) -> list[str]:
        return sorted(text(k) or "" for k in await self._do(
            lambda: self.r.smembers(self.keys.refs(digest))))

    async def blob_namespaces(self, digest: str) -> list[str]:
        return sorted(text(n) or "" for n in await self._do(
            lambda: self.r.smembers(self.keys.blob_owners(digest))))

    async def add_quarantine(self, record: QuarantineRecord) -> None:
        raw = json.dumps({"digest": record.digest, "reason": record.reason,
                          "detail": record.detail, "reporter": record.reporter,
                          "at": record.at, "size": record.size,
                          "namespaces": list(record.namespaces),
                          "withdrawn": list(record.withdrawn),
                          "reporter_namespace": record.reporter_namespace})

        async def op() -> None:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.lpush(self.keys.quarantine(), raw)
                pipe.ltrim(self.keys.quarantine(), 0, MAX_QUARANTINE_RECORDS - 1)
                pipe.hincrby(self.keys.quarantine_counts(), record.reason, 1)
                if record.digest:
                    pipe.sadd(self.keys.quarantined(), record.digest)
                await pipe.execute()

        await self._do(op)

    async def quarantines(self, *, namespace: str | None, limit: int
                          ) -> list[QuarantineRecord]:
        rows = await self._do(lambda: self.r.lrange(self.keys.quarantine(), 0, -1))
        return newest_touching((_record(json.loads(raw)) for raw in rows), namespace, limit)

    async def quarantine_counts(self) -> dict[str, int]:
        raw = await self._do(lambda: self.r.hgetall(self.keys.quarantine_counts()))
        return {text(k) or "": int(v) for k, v in raw.items()}

    async def quarantined(self, digests: list[str]) -> set[str]:
        if not digests:
            return set()
        flags = await self._do(lambda: self.r.smismember(self.keys.quarantined(), digests))
        return {d for d, f in zip(digests, flags, strict=True) if f}

    async def clear_quarantined(self, digest: str) -> None:
        await self._do(lambda: self.r.srem(self.keys.quarantined(), digest))

    async def add_load_report(self, key: str, etag: str, reporter: str, now: float) -> int:
        name = self.keys.load_reports(key, etag)

        async def op() -> int:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.sadd(name, reporter)
                pipe.expire(name, LOAD_REPORT_TTL_S)
                pipe.scard(name)
                _, _, count = await pipe.execute()
            return int(count)

        return await self._do(op)

    async def mark_verified(self, digest: str, at: float) -> None:
        async def op() -> None:
            if await self.r.hexists(self.keys.blobs(), digest):  # not for a forgotten blob
                await self.r.zadd(self.keys.blob_verified(), {digest: at}, gt=True)

        await self._do(op)

    async def least_verified(self, limit: int) -> list[tuple[BlobRecord, float]]:
        async def op() -> list[tuple[BlobRecord, float]]:
            if await self.r.zcard(self.keys.blob_verified()) < \
                    await self.r.hlen(self.keys.blobs()):
                await self._seed_verified()
            ranked = await self.r.zrange(self.keys.blob_verified(), 0, limit - 1,
                                         withscores=True)
            digests = [text(d) or "" for d, _ in ranked]
            if not digests:
                return []
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.hmget(self.keys.blobs(), digests)
                pipe.zmscore(self.keys.blob_touched(), digests)
                sizes, touched = await pipe.execute()
            return [(BlobRecord(d, int(size), float(t or 0.0)), float(at))
                    for d, (_, at), size, t in zip(digests, ranked, sizes, touched, strict=True)
                    if size is not None]

        return await self._do(op)

    async def _seed_verified(self) -> None:
        """Blobs recorded before verification was tracked count as never verified."""
        cursor = 0
        while True:
            cursor, page = await self.r.hscan(self.keys.blobs(), cursor, count=SCAN)
            if page:
                await self.r.zadd(self.keys.blob_verified(), dict.fromkeys(page, 0.0), nx=True)
            if not cursor:
                return


def _record(d: dict[str, Any]) -> QuarantineRecord:
    return QuarantineRecord(d["digest"], d["reason"], d["detail"], d["reporter"],
                            float(d["at"]), int(d["size"]), tuple(d["namespaces"]),
                            tuple(d["withdrawn"]), d.get("reporter_namespace", ""))
