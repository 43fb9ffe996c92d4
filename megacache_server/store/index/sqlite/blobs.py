"""BlobLedger on SQLite: a row per blob, a row per (namespace, blob) in `blob_owners`, and
each blob's reference count kept by triggers (`schema.py`), so GC reads the unreferenced
blobs from an index of just those."""

from __future__ import annotations

import sqlite3
import time

from megacache_server.store.index.protocols.blobs import BlobLedger, BlobRecord
from megacache_server.store.index.sqlite.connection import (
    SCAN_PAGE,
    SqliteConnection,
    batches,
    marks,
    transaction,
)

PENDING = """SELECT COALESCE(SUM(b.size), 0) FROM blob_owners o JOIN blobs b USING (digest)
    WHERE o.namespace = ? AND NOT EXISTS (SELECT 1 FROM entry_blobs e JOIN entries n
        ON n.key = e.key WHERE e.digest = o.digest AND n.namespace = o.namespace)"""
"""A namespace's pending bytes: its blobs that none of its own entries name."""


def pending_of(c: sqlite3.Connection, namespace: str) -> int:
    return int(c.execute(PENDING, (namespace,)).fetchone()[0])


class SqliteBlobs(SqliteConnection, BlobLedger):
    async def record_blob(self, digest: str, size: int, namespace: str) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            now = time.time()
            with transaction(c, immediate=True):
                c.execute("""INSERT INTO blobs (digest, size, created_at, touched_at,
                               verified_at) VALUES (?, ?, ?, ?, ?)
                             ON CONFLICT(digest) DO UPDATE SET touched_at=excluded.touched_at""",
                          (digest, size, now, now, now))
                return c.execute("INSERT OR IGNORE INTO blob_owners (namespace, digest) "
                                 "VALUES (?, ?)", (namespace, digest)).rowcount > 0

        return await self._run(op)

    async def stored_bytes(self) -> int:
        row = await self._read("SELECT bytes FROM blob_total WHERE id=1", ())
        return int(row[0]) if row else 0

    async def pending_bytes(self, namespace: str) -> int:
        return await self._run(lambda c: pending_of(c, namespace))

    async def recorded_digests(self) -> set[str]:
        return await self._run(lambda c: {d for (d,) in c.execute("SELECT digest FROM blobs")})

    async def blob_record(self, digest: str) -> BlobRecord | None:
        row = await self._read("SELECT digest, size, touched_at FROM blobs WHERE digest=?",
                               (digest,))
        return BlobRecord(*row) if row else None

    async def reference_counts(self, digests: list[str]) -> dict[str, int]:
        counts = dict.fromkeys(digests, 0)
        for part in batches(digests):
            counts.update(await self._rows(
                f"SELECT digest, COUNT(*) FROM entry_blobs WHERE digest IN ({marks(part)}) "
                "GROUP BY digest", part))
        return counts

    async def blob_records_of(self, digests: list[str]) -> dict[str, BlobRecord]:
        found: dict[str, BlobRecord] = {}
        for part in batches(digests):
            rows = await self._rows(
                f"SELECT digest, size, touched_at FROM blobs WHERE digest IN ({marks(part)})",
                part)
            found.update((r[0], BlobRecord(*r)) for r in rows)
        return found

    async def unreferenced_blobs(self) -> list[BlobRecord]:
        """From the index of blobs no entry names (REFS_SCHEMA), in pages of SCAN_PAGE, each
        one short read on the writer: cost follows what GC may collect, not the store."""
        found: list[BlobRecord] = []
        after = ""
        while True:
            rows = await self._rows(
                "SELECT digest, size, touched_at FROM blobs INDEXED BY blobs_unreferenced "
                "WHERE refs = 0 AND digest > ? ORDER BY digest LIMIT ?", (after, SCAN_PAGE))
            found += [BlobRecord(*row) for row in rows]
            if len(rows) < SCAN_PAGE:
                return found
            after = rows[-1][0]

    async def touch_blobs(self, digests: list[str]) -> None:
        now = time.time()
        await self._write(lambda c: c.executemany(
            "UPDATE blobs SET touched_at=? WHERE digest=?", [(now, d) for d in digests]))

    async def forget_blobs(self, digests: list[str]) -> None:
        def op(c: sqlite3.Connection, part: list[str]) -> int:
            c.execute(f"DELETE FROM blob_owners WHERE digest IN ({marks(part)})", part)
            return c.execute(f"DELETE FROM blobs WHERE digest IN ({marks(part)})",
                             part).rowcount

        await self._write_batches(batches(digests), op)

    async def owns_blob(self, namespace: str, digest: str) -> bool:
        return await self._read("SELECT 1 FROM blob_owners WHERE namespace=? AND digest=?",
                                (namespace, digest)) is not None
