"""Index in SQLite (WAL): the embedded default, safe across several uvicorn workers.

One module per storage protocol of `protocols/` (of the same name), each a class on the
shared connections of `connection.py`; the tables are in `schema.py`. `SqliteIndex` is
made of those classes.
"""

from __future__ import annotations

from megacache_server.store.index.base import Index
from megacache_server.store.index.sqlite.blobs import SqliteBlobs
from megacache_server.store.index.sqlite.entries import SqliteEntries
from megacache_server.store.index.sqlite.ett_rollups import SqliteEttRollups
from megacache_server.store.index.sqlite.events import SqliteEvents
from megacache_server.store.index.sqlite.jobs import SqliteJobs
from megacache_server.store.index.sqlite.locks import SqliteLocks
from megacache_server.store.index.sqlite.progress import SqliteProgress
from megacache_server.store.index.sqlite.quotas import SqliteQuotas
from megacache_server.store.index.sqlite.rates import SqliteRates
from megacache_server.store.index.sqlite.tokens import SqliteTokens
from megacache_server.store.index.sqlite.trust import SqliteTrust


class SqliteIndex(SqliteEntries, SqliteBlobs, SqliteQuotas, SqliteTokens, SqliteEvents,
                  SqliteRates, SqliteLocks, SqliteJobs, SqliteTrust, SqliteProgress,
                  SqliteEttRollups, Index):
    name = "sqlite"


__all__ = ["SqliteIndex"]
