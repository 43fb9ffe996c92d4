"""QuotaStore on SQLite: a row per hold in `pending_holds`, decided inside `BEGIN IMMEDIATE`
with the namespace's pending bytes read in the same transaction, so every process on the
file sees the same room and no two holds pass on it."""

from __future__ import annotations

import sqlite3

from megacache_server.store.index.protocols.quotas import PendingHold, QuotaStore
from megacache_server.store.index.sqlite.blobs import pending_of
from megacache_server.store.index.sqlite.connection import SqliteConnection, transaction


class SqliteQuotas(SqliteConnection, QuotaStore):
    async def hold_pending(self, namespace: str, hold_id: str, size: int, cap: int,
                           ttl_s: float, now: float) -> PendingHold:
        def op(c: sqlite3.Connection) -> PendingHold:
            with transaction(c, immediate=True):
                c.execute("DELETE FROM pending_holds WHERE expires_at <= ?", (now,))
                if c.execute("UPDATE pending_holds SET expires_at = ? WHERE namespace = ? "
                             "AND hold_id = ?", (now + ttl_s, namespace, hold_id)).rowcount:
                    return PendingHold(True, 0, 0)  # renewed: the bytes were held already
                pending = pending_of(c, namespace)
                held = int(c.execute("SELECT COALESCE(SUM(size), 0) FROM pending_holds "
                                     "WHERE namespace = ?", (namespace,)).fetchone()[0])
                if pending + held + size > cap:
                    return PendingHold(False, pending, held)
                c.execute("INSERT INTO pending_holds (namespace, hold_id, size, expires_at) "
                          "VALUES (?, ?, ?, ?)", (namespace, hold_id, size, now + ttl_s))
                return PendingHold(True, pending, held)

        return await self._run(op)

    async def release_pending(self, namespace: str, hold_id: str) -> None:
        await self._write(lambda c: c.execute(
            "DELETE FROM pending_holds WHERE namespace = ? AND hold_id = ?",
            (namespace, hold_id)))
