"""LockStore on SQLite: a row per held lock, with its owner and expiry, taken inside
`BEGIN IMMEDIATE` so every process on the file agrees who holds it."""

from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path

from megacache_server.store.index.protocols.locks import LockStore
from megacache_server.store.index.sqlite.connection import SqliteConnection, transaction


class SqliteLocks(SqliteConnection, LockStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._owner = uuid.uuid4().hex

    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            now = time.time()
            with transaction(c, immediate=True):
                row = c.execute("SELECT owner, expires_at FROM locks WHERE name=?",
                                (name,)).fetchone()
                if row and row[0] != self._owner and row[1] > now:
                    return False
                c.execute("INSERT OR REPLACE INTO locks (name, owner, expires_at) "
                          "VALUES (?, ?, ?)", (name, self._owner, now + ttl_s))
                return True

        return await self._run(op)

    async def release_lock(self, name: str) -> None:
        await self._write(lambda c: c.execute("DELETE FROM locks WHERE name=? AND owner=?",
                                            (name, self._owner)))
