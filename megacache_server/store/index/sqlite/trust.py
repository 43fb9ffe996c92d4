"""TrustStore on SQLite: tables `quarantine`, `quarantine_counts`, `quarantined_blobs` and
`load_reports`; a blob's last verification is a column of its row (`blobs.verified_at`)."""

from __future__ import annotations

import json
import sqlite3

from megacache_server.store.index.protocols.blobs import BlobRecord
from megacache_server.store.index.protocols.trust import (
    MAX_QUARANTINE_RECORDS,
    QuarantineRecord,
    TrustStore,
    newest_touching,
)
from megacache_server.store.index.sqlite.connection import (
    SqliteConnection,
    batches,
    marks,
    transaction,
)

LOAD_REPORT_TTL_S = 7 * 86400.0
"""Reports older than this no longer count toward withdrawing an entry."""


class SqliteTrust(SqliteConnection, TrustStore):
    async def entries_naming(self, digest: str) -> list[str]:
        return [k for (k,) in await self._rows(
            "SELECT key FROM entry_blobs WHERE digest=? ORDER BY key", (digest,))]

    async def blob_namespaces(self, digest: str) -> list[str]:
        return [n for (n,) in await self._rows(
            "SELECT namespace FROM blob_owners WHERE digest=? ORDER BY namespace", (digest,))]

    async def add_quarantine(self, record: QuarantineRecord) -> None:
        def op(c: sqlite3.Connection) -> None:
            with transaction(c, immediate=True):
                c.execute("""INSERT INTO quarantine (digest, reason, detail, reporter, at, size,
                               namespaces, withdrawn, reporter_namespace)
                             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                          (record.digest, record.reason, record.detail, record.reporter,
                           record.at, record.size, json.dumps(list(record.namespaces)),
                           json.dumps(list(record.withdrawn)), record.reporter_namespace))
                c.execute("INSERT INTO quarantine_counts VALUES (?, 1) ON CONFLICT (reason) "
                          "DO UPDATE SET count = count + 1", (record.reason,))
                if record.digest:
                    c.execute("INSERT OR IGNORE INTO quarantined_blobs VALUES (?)",
                              (record.digest,))
                c.execute("DELETE FROM quarantine WHERE id <= (SELECT MAX(id) FROM quarantine)"
                          " - ?", (MAX_QUARANTINE_RECORDS,))

        await self._run(op)

    async def quarantines(self, *, namespace: str | None, limit: int
                          ) -> list[QuarantineRecord]:
        rows = await self._rows(
            "SELECT digest, reason, detail, reporter, at, size, namespaces, withdrawn, "
            "reporter_namespace FROM quarantine ORDER BY id DESC LIMIT ?",
            (MAX_QUARANTINE_RECORDS,))
        return newest_touching(
            (QuarantineRecord(digest, reason, detail, reporter, at, int(size),
                              tuple(json.loads(namespaces)), tuple(json.loads(withdrawn)), rns)
             for digest, reason, detail, reporter, at, size, namespaces, withdrawn, rns in rows),
            namespace, limit)

    async def quarantine_counts(self) -> dict[str, int]:
        return {r: int(n) for r, n in await self._rows(
            "SELECT reason, count FROM quarantine_counts", ())}

    async def quarantined(self, digests: list[str]) -> set[str]:
        found: set[str] = set()
        for part in batches(digests):
            found |= {d for (d,) in await self._rows(
                f"SELECT digest FROM quarantined_blobs WHERE digest IN ({marks(part)})", part)}
        return found

    async def clear_quarantined(self, digest: str) -> None:
        await self._write(lambda c: c.execute(
            "DELETE FROM quarantined_blobs WHERE digest=?", (digest,)))

    async def add_load_report(self, key: str, etag: str, reporter: str, now: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            with transaction(c, immediate=True):
                c.execute("DELETE FROM load_reports WHERE at < ?", (now - LOAD_REPORT_TTL_S,))
                c.execute("INSERT OR IGNORE INTO load_reports VALUES (?, ?, ?, ?)",
                          (key, etag, reporter, now))
                return int(c.execute("SELECT COUNT(*) FROM load_reports WHERE key=? AND etag=?",
                                     (key, etag)).fetchone()[0])

        return await self._run(op)

    async def mark_verified(self, digest: str, at: float) -> None:
        await self._write(lambda c: c.execute(
            "UPDATE blobs SET verified_at=MAX(verified_at, ?) WHERE digest=?", (at, digest)))

    async def least_verified(self, limit: int) -> list[tuple[BlobRecord, float]]:
        rows = await self._rows(
            "SELECT digest, size, touched_at, verified_at FROM blobs INDEXED BY "
            "blobs_by_verified ORDER BY verified_at, digest LIMIT ?", (limit,))
        return [(BlobRecord(d, int(s), t), float(v)) for d, s, t, v in rows]
