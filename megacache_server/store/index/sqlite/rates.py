"""RateStore on SQLite: a row per token bucket, taken from inside `BEGIN IMMEDIATE` so every
worker on the file draws on the same bucket. Committed without an fsync (`unsynced`): a
bucket is state worth losing on a power cut, not a write per request worth waiting for."""

from __future__ import annotations

import sqlite3

from megacache_server.store.index.protocols.rates import RateStore, refill
from megacache_server.store.index.sqlite.connection import (
    SqliteConnection,
    transaction,
    unsynced,
)


class SqliteRates(SqliteConnection, RateStore):
    async def take(self, bucket: str, rate: float, burst: float, now: float) -> float:
        def op(c: sqlite3.Connection) -> float:
            with unsynced(c), transaction(c, immediate=True):
                row = c.execute("SELECT tokens, at FROM rate_buckets WHERE bucket = ?",
                                (bucket,)).fetchone()
                tokens, wait = refill(row, rate, burst, now)
                c.execute("INSERT OR REPLACE INTO rate_buckets (bucket, tokens, at) "
                          "VALUES (?, ?, ?)", (bucket, tokens, now))
                return wait

        return await self._run(op)
