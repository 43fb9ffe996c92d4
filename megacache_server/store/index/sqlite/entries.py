"""EntryStore on SQLite: an entry's row carries the columns eviction, quotas and listings
read; the blobs it names are rows of `entry_blobs`.

A lookup's last-access time is kept in memory and written with the others once a second:
a write per lookup would queue every job start behind SQLite's single writer.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from megacache_server.errors import ServiceUnavailable
from megacache_server.store.index.protocols import entries
from megacache_server.store.index.sqlite.connection import (
    SqliteConnection,
    batches,
    filters,
    marks,
    transaction,
)

ACCESS_FLUSH_S = 1.0
INFO_COLUMNS = ("key, namespace, model, size, created_at, updated_at, last_access, pinned, "
                "(SELECT group_concat(digest) FROM entry_blobs b WHERE b.key = entries.key)")
ENTRY_COLUMNS = INFO_COLUMNS + ", manifest, etag, provenance"


class SqliteEntries(SqliteConnection, entries.EntryStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._touched: dict[str, float] = {}
        self._flushed_at = time.monotonic()
        self._flushing: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._flushing is not None:
            await self._flushing
        if self._conn is not None:
            pending, self._touched = self._touched, {}
            await self._run(lambda c: _flush_access(c, pending))
        await super().close()

    async def get(self, key: str, *, touch: bool = True) -> entries.StoredEntry | None:
        row = await self._read(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE key=?", (key,))
        if row is None:
            return None
        entry = _stored(row)
        return await self.touch(entry) if touch else entry

    async def touch(self, entry: entries.StoredEntry) -> entries.StoredEntry:
        now = time.time()
        self._touched[entry.key] = now
        if time.monotonic() - self._flushed_at >= ACCESS_FLUSH_S and self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        return replace(entry, last_access=now)

    async def flush_access(self) -> None:
        if self._flushing is not None:
            await self._flushing
        pending, self._touched = self._touched, {}
        await self._run(lambda c: _flush_access(c, pending))

    async def _flush(self) -> None:
        """Write buffered last-access times: one transaction a second, not one per lookup.

        A lookup is the hottest request (every rank of every job start); a write each
        would serialize them on SQLite's single writer across all workers.
        """
        pending, self._touched = self._touched, {}
        try:
            await self._run(lambda c: _flush_access(c, pending))
        except ServiceUnavailable:
            pass  # last-access times are advisory; the next flush carries newer ones
        finally:
            self._flushed_at = time.monotonic()
            self._flushing = None

    async def put(self, entry: entries.NewEntry, condition: entries.Precondition
                  ) -> tuple[entries.StoredEntry, bool]:
        etag = entries.entry_etag(entry.manifest_json)

        def op(c: sqlite3.Connection) -> tuple[entries.StoredEntry, bool]:
            now = time.time()
            with transaction(c, immediate=True):
                row = c.execute("SELECT etag, pinned FROM entries WHERE key=?",
                                (entry.key,)).fetchone()
                entries.check_precondition(condition, row[0] if row else None)
                last = c.execute("SELECT sequence FROM sequences WHERE key=?",
                                 (entry.key,)).fetchone()
                sequence = max(last[0] + 1 if last else 1, entry.sequence_floor)
                c.execute("INSERT OR REPLACE INTO sequences (key, sequence) VALUES (?, ?)",
                          (entry.key, sequence))
                provenance = entries.sequenced(entry.provenance, sequence)
                c.execute(
                    """INSERT INTO entries (key, manifest, etag, namespace, model, env_digest,
                         hw_digest, size, created_at, updated_at, last_access, provenance)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                       ON CONFLICT(key) DO UPDATE SET manifest=excluded.manifest,
                         etag=excluded.etag, namespace=excluded.namespace,
                         model=excluded.model, env_digest=excluded.env_digest,
                         hw_digest=excluded.hw_digest, size=excluded.size,
                         created_at=excluded.created_at, updated_at=excluded.updated_at,
                         last_access=excluded.last_access, provenance=excluded.provenance""",
                    (entry.key, entry.manifest_json, etag, entry.namespace, entry.model,
                     entry.env_digest, entry.hw_digest, entry.size, entry.created_at, now, now,
                     provenance))
                c.execute("DELETE FROM entry_blobs WHERE key=?", (entry.key,))
                c.executemany("INSERT INTO entry_blobs (key, digest) VALUES (?, ?)",
                              [(entry.key, d) for d in entry.digests])
            stored = entries.StoredEntry(entry.key, entry.namespace, entry.model, entry.digests,
                                         entry.size, entry.created_at, now, now,
                                         bool(row and row[1]), entry.manifest_json, etag,
                                         provenance)
            return stored, row is None

        return await self._run(op)

    async def list_entries(self, *, namespace: str | None = None, model: str | None = None,
                           env_digest: str | None = None, hw_digest: str | None = None,
                           limit: int) -> list[entries.StoredEntry]:
        where, args = filters(namespace=namespace, model=model, env_digest=env_digest,
                              hw_digest=hw_digest)
        sql = (f"SELECT {ENTRY_COLUMNS} FROM entries{where} "
               "ORDER BY created_at DESC, key LIMIT ?")
        return await self._run(lambda c: [_stored(r) for r in c.execute(
            sql, (*args, limit)).fetchall()])

    async def entry_digests(self) -> dict[str, tuple[str, ...]]:
        def op(c: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
            named: dict[str, list[str]] = {}
            for key, digest in c.execute("SELECT key, digest FROM entry_blobs"):
                named.setdefault(key, []).append(digest)
            return {key: tuple(named.get(key, ())) for (key,) in c.execute(
                "SELECT key FROM entries")}

        return await self._run(op)

    async def largest_entries(self, *, namespace: str | None, limit: int
                              ) -> list[entries.EntryInfo]:
        where, args = filters(namespace=namespace)
        sql = f"SELECT {INFO_COLUMNS} FROM entries{where} ORDER BY size DESC, key LIMIT ?"
        return await self._run(lambda c: [_info(r) for r in c.execute(
            sql, (*args, limit)).fetchall()])

    async def usage(self, namespace: str | None = None) -> tuple[int, int]:
        where, args = filters(namespace=namespace)
        row = await self._read(
            f"SELECT COALESCE(SUM(entries), 0), COALESCE(SUM(bytes), 0) FROM usage{where}", args)
        return (int(row[0]), int(row[1])) if row else (0, 0)

    async def delete(self, key: str, *, unless_pinned: bool = False) -> bool:
        return await self.delete_many([key], unless_pinned=unless_pinned) == 1

    async def delete_unpinned(self, keys: list[str]) -> int:
        return await self.delete_many(keys, unless_pinned=True)

    async def delete_many(self, keys: list[str], *, unless_pinned: bool) -> int:
        """Entries deleted in transactions of BATCH keys (eviction of many: few commits, and
        the writer is free between batches)."""
        # +pinned: the key is the index to use (SQLite would pick the pinned index and scan
        # every unpinned entry per statement)
        extra = " AND +pinned=0" if unless_pinned else ""
        return await self._write_batches(batches(keys), lambda c, part: c.execute(
            f"DELETE FROM entries WHERE key IN ({marks(part)}){extra}", part).rowcount)

    async def set_pinned(self, key: str, pinned: bool) -> bool:
        return await self._run(lambda c: c.execute(
            "UPDATE entries SET pinned=? WHERE key=?", (int(pinned), key)).rowcount > 0)

    async def lru_entries(self, limit: int, *, namespace: str | None = None,
                          after: entries.EntryInfo | None = None) -> list[entries.EntryInfo]:
        pending, self._touched = self._touched, {}
        where = " AND namespace=?" if namespace is not None else ""
        args: tuple[Any, ...] = (namespace,) if namespace is not None else ()
        if after is not None:  # keyset paging: OFFSET would evaluate every row it skips
            where += " AND (last_access, key) > (?, ?)"
            args += (after.last_access, after.key)

        def op(c: sqlite3.Connection) -> list[entries.EntryInfo]:
            _flush_access(c, pending)
            return [_info(r) for r in c.execute(
                f"SELECT {INFO_COLUMNS} FROM entries WHERE pinned=0{where} "
                "ORDER BY last_access, key LIMIT ?", (*args, limit)).fetchall()]

        return await self._run(op)


def _flush_access(c: sqlite3.Connection, touched: dict[str, float]) -> None:
    if touched:
        with transaction(c, immediate=True):
            c.executemany("UPDATE entries SET last_access=MAX(last_access, ?) WHERE key=?",
                          [(t, k) for k, t in touched.items()])


def _info(row: tuple[Any, ...]) -> entries.EntryInfo:
    key, namespace, model, size, created_at, updated_at, last_access, pinned, digests = row[:9]
    return entries.EntryInfo(key, namespace, model, tuple(digests.split(",")) if digests else (),
                             int(size), created_at, updated_at, last_access, bool(pinned))


def _stored(row: tuple[Any, ...]) -> entries.StoredEntry:
    info = _info(row)
    return entries.StoredEntry(**vars(info), manifest_json=bytes(row[9]), etag=row[10],
                               provenance=row[11] if len(row) > 11 else "")
