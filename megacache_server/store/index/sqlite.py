"""Index in SQLite (WAL): the embedded default, safe across several uvicorn workers.

Two connections per process:
- a writer, used from worker threads under a lock, for every write and every query whose
  cost grows with the store (GC plans, fsck, rollup sums);
- a reader, used on the event loop itself for point lookups by primary key (an entry, a
  token, a blob, the running totals), which take microseconds: no thread hop on the hottest
  requests. A reader that meets a lock gives up at once and the lookup goes through the
  writer instead.
Processes coordinate through SQLite's own locking (WAL + busy timeout); conditional writes
run inside `BEGIN IMMEDIATE` so check-then-write is atomic across processes.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from anyio import to_thread

from megacache_client.events import Event
from megacache_server.errors import ServiceUnavailable
from megacache_server.store.index import base
from megacache_server.store.index.base import Index

T = TypeVar("T")
SCHEMA_VERSION = 2
_SUMS = ", ".join(f"{c} REAL NOT NULL DEFAULT 0" for c in base.COUNTERS)

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS entries (
    key          TEXT PRIMARY KEY,
    manifest     BLOB NOT NULL,
    etag         TEXT NOT NULL,
    namespace    TEXT NOT NULL,
    model        TEXT NOT NULL,
    env_digest   TEXT NOT NULL,
    hw_digest    TEXT NOT NULL,
    size         INTEGER NOT NULL,
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL,
    last_access  REAL NOT NULL,
    pinned       INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_by_model ON entries (model, created_at DESC);
CREATE INDEX IF NOT EXISTS entries_by_env_hw ON entries (env_digest, hw_digest, created_at DESC);
CREATE INDEX IF NOT EXISTS entries_by_namespace ON entries (namespace, created_at DESC);
CREATE INDEX IF NOT EXISTS entries_by_access ON entries (pinned, last_access);
CREATE INDEX IF NOT EXISTS entries_by_size ON entries (namespace, size DESC);
CREATE INDEX IF NOT EXISTS entries_by_size_all ON entries (size DESC, key);
CREATE INDEX IF NOT EXISTS entries_by_model_env_hw
    ON entries (model, env_digest, hw_digest, created_at DESC);
CREATE TABLE IF NOT EXISTS entry_blobs (
    key    TEXT NOT NULL REFERENCES entries(key) ON DELETE CASCADE,
    digest TEXT NOT NULL,
    PRIMARY KEY (key, digest)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entry_blobs_by_digest ON entry_blobs (digest);
CREATE TABLE IF NOT EXISTS blobs (
    digest      TEXT PRIMARY KEY,
    size        INTEGER NOT NULL,
    created_at  REAL NOT NULL,
    touched_at  REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blob_owners (
    namespace  TEXT NOT NULL,
    digest     TEXT NOT NULL,
    PRIMARY KEY (namespace, digest)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blob_owners_by_digest ON blob_owners (digest);
CREATE TABLE IF NOT EXISTS tokens (
    token_id    TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    token_hash  TEXT NOT NULL,
    scopes      TEXT NOT NULL,
    namespace   TEXT NOT NULL,
    created_at  REAL NOT NULL,
    revoked     INTEGER NOT NULL DEFAULT 0,
    expires_at  REAL
);
CREATE TABLE IF NOT EXISTS locks (
    name        TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    expires_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id          INTEGER PRIMARY KEY,
    received_at REAL NOT NULL,
    namespace   TEXT NOT NULL,
    event       BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_time ON events (received_at);
CREATE TABLE IF NOT EXISTS rollup_hourly (
    namespace TEXT NOT NULL, hour INTEGER NOT NULL, model TEXT NOT NULL, {_SUMS},
    PRIMARY KEY (namespace, hour, model)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS rollup_by_hour ON rollup_hourly (hour);
CREATE TABLE IF NOT EXISTS rollup_total (
    namespace TEXT NOT NULL, model TEXT NOT NULL, {_SUMS},
    PRIMARY KEY (namespace, model)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS miss_reasons (
    namespace TEXT NOT NULL, hour INTEGER NOT NULL, model TEXT NOT NULL,
    outcome TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,
    PRIMARY KEY (namespace, hour, model, outcome, reason)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS miss_reasons_by_hour ON miss_reasons (hour);
CREATE TABLE IF NOT EXISTS heartbeat (id INTEGER PRIMARY KEY, at REAL NOT NULL);
"""

DAILY_SCHEMA = f"""
CREATE TABLE rollup_daily (
    namespace TEXT NOT NULL, day INTEGER NOT NULL, model TEXT NOT NULL, {_SUMS},
    PRIMARY KEY (namespace, day, model)
) WITHOUT ROWID;
CREATE INDEX rollup_daily_by_day ON rollup_daily (day);
CREATE TABLE miss_reasons_daily (
    namespace TEXT NOT NULL, day INTEGER NOT NULL, model TEXT NOT NULL,
    outcome TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,
    PRIMARY KEY (namespace, day, model, outcome, reason)
) WITHOUT ROWID;
CREATE INDEX miss_reasons_daily_by_day ON miss_reasons_daily (day);
INSERT INTO rollup_daily SELECT namespace, hour / {base.DAY} * {base.DAY}, model,
    {", ".join(f"TOTAL({c})" for c in base.COUNTERS)} FROM rollup_hourly GROUP BY 1, 2, 3;
INSERT INTO miss_reasons_daily SELECT namespace, hour / {base.DAY} * {base.DAY}, model,
    outcome, reason, SUM(count) FROM miss_reasons GROUP BY 1, 2, 3, 4, 5;
"""
"""Daily rollups beside the hourly ones (long windows sum days); added to older stores with
what their hourly rollups hold."""

USAGE_SCHEMA = """
CREATE TABLE usage (
    namespace TEXT PRIMARY KEY, entries INTEGER NOT NULL, bytes INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE blob_total (id INTEGER PRIMARY KEY CHECK (id = 1), bytes INTEGER NOT NULL);
INSERT INTO usage SELECT namespace, COUNT(*), SUM(size) FROM entries GROUP BY namespace;
INSERT INTO blob_total VALUES (1, (SELECT COALESCE(SUM(size), 0) FROM blobs));
CREATE TRIGGER usage_entry_insert AFTER INSERT ON entries BEGIN
    INSERT INTO usage VALUES (NEW.namespace, 1, NEW.size) ON CONFLICT (namespace)
        DO UPDATE SET entries = entries + 1, bytes = bytes + NEW.size;
END;
CREATE TRIGGER usage_entry_delete AFTER DELETE ON entries BEGIN
    UPDATE usage SET entries = entries - 1, bytes = bytes - OLD.size
        WHERE namespace = OLD.namespace;
END;
CREATE TRIGGER usage_entry_update AFTER UPDATE OF namespace, size ON entries BEGIN
    UPDATE usage SET entries = entries - 1, bytes = bytes - OLD.size
        WHERE namespace = OLD.namespace;
    INSERT INTO usage VALUES (NEW.namespace, 1, NEW.size) ON CONFLICT (namespace)
        DO UPDATE SET entries = entries + 1, bytes = bytes + NEW.size;
END;
CREATE TRIGGER blob_total_insert AFTER INSERT ON blobs BEGIN
    UPDATE blob_total SET bytes = bytes + NEW.size;
END;
CREATE TRIGGER blob_total_delete AFTER DELETE ON blobs BEGIN
    UPDATE blob_total SET bytes = bytes - OLD.size;
END;
"""
"""Entry counts and bytes per namespace, and the blob store's total, kept by triggers as
rows change (whoever writes them), so a scrape or the dashboard reads a row instead of
summing a million. Created, and filled from the rows already there, on first open."""

REFS_SCHEMA = """
ALTER TABLE blobs ADD COLUMN refs INTEGER NOT NULL DEFAULT 0;
UPDATE blobs SET refs = (SELECT COUNT(*) FROM entry_blobs e WHERE e.digest = blobs.digest);
CREATE INDEX blobs_unreferenced ON blobs (digest) WHERE refs = 0;
CREATE TRIGGER blob_refs_insert AFTER INSERT ON entry_blobs BEGIN
    UPDATE blobs SET refs = refs + 1 WHERE digest = NEW.digest;
END;
CREATE TRIGGER blob_refs_delete AFTER DELETE ON entry_blobs BEGIN
    UPDATE blobs SET refs = refs - 1 WHERE digest = OLD.digest;
END;
CREATE TRIGGER blob_refs_recorded AFTER INSERT ON blobs BEGIN
    UPDATE blobs SET refs = (SELECT COUNT(*) FROM entry_blobs e WHERE e.digest = NEW.digest)
        WHERE digest = NEW.digest;
END;
"""
"""How many entries name each blob, kept by triggers (entry writes and deletes, cascades
included; a blob recorded after the entries naming it, as fsck does, counts them), with an
index of just the blobs no entry names: GC finds those without visiting the million
others (3.6 s of a 7.5 s plan at a million entries). Added to older stores on first open."""

ACCESS_FLUSH_S = 1.0
INFO_COLUMNS = ("key, namespace, model, size, created_at, updated_at, last_access, pinned, "
                "(SELECT group_concat(digest) FROM entry_blobs b WHERE b.key = entries.key)")
ENTRY_COLUMNS = INFO_COLUMNS + ", manifest, etag"
BATCH = 500
"""Keys or digests per statement in batched reads and deletes."""
SCAN_PAGE = 5000
"""Rows per page when a scan crosses the whole store."""
_UPSERT = ", ".join(f"{c}={c}+excluded.{c}" for c in base.COUNTERS)


class SqliteIndex(Index):
    name = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._owner = uuid.uuid4().hex
        self._touched: dict[str, float] = {}
        self._flushed_at = time.monotonic()
        self._flushing: asyncio.Task[None] | None = None

    async def open(self) -> None:
        await to_thread.run_sync(self._open_sync)

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: an entry acknowledged with 201 survives a power loss, not only a crash.
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        with _transaction(conn, immediate=True):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            has_entries = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE name='entries'").fetchone()
            if has_entries and version != SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path} holds an index of schema {version}, this server reads "
                    f"{SCHEMA_VERSION}: start from an empty data dir (blobs can be re-uploaded)")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            for table, script in (("usage", USAGE_SCHEMA), ("rollup_daily", DAILY_SCHEMA),
                                  ("blobs_unreferenced", REFS_SCHEMA)):
                if not conn.execute("SELECT 1 FROM sqlite_master WHERE name=?",
                                    (table,)).fetchone():
                    for statement in _statements(script):
                        conn.execute(statement)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        reader = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=0.05,
                                 isolation_level=None, check_same_thread=False)
        self._conn, self._reader = conn, reader

    async def close(self) -> None:
        if self._flushing is not None:
            await self._flushing
        if self._conn is not None:
            pending, self._touched = self._touched, {}
            await self._run(lambda c: _flush_access(c, pending))
            await self._run(lambda c: c.close())
            self._conn = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` on the writer connection, in a worker thread, holding the connection lock
        for as long as any cursor of it is in use (cursors never leave `fn`)."""
        def call() -> T:
            with self._lock:
                if self._conn is None:
                    raise ServiceUnavailable("index is not open", code="index_unavailable")
                try:
                    result = fn(self._conn)
                    if isinstance(result, sqlite3.Cursor):
                        # finish a returned cursor under the lock: freed later on another
                        # thread it races the connection (sqlite3.InterfaceError, issue 11)
                        result.close()
                        return None  # type: ignore[return-value]
                    return result
                except sqlite3.OperationalError as exc:
                    raise ServiceUnavailable(
                        f"index error: {exc}", code="index_unavailable") from exc

        return await to_thread.run_sync(call)

    async def _write(self, fn: Callable[[sqlite3.Connection], sqlite3.Cursor]) -> None:
        """A statement run for its effect. Its cursor is closed under the connection lock:
        a cursor finalized later, in another thread, while the connection runs another
        statement is what made SQLite report "bad parameter or other API misuse"."""
        await self._run(lambda c: fn(c).close())

    async def _read(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """One row by primary key, on the event loop; through the writer if it meets a lock."""
        if self._reader is not None:
            try:
                row: tuple[Any, ...] | None = self._reader.execute(sql, args).fetchone()
                return row
            except sqlite3.OperationalError:
                pass
        return await self._run(lambda c: c.execute(sql, args).fetchone())

    # -- entries ------------------------------------------------------------------------
    async def get(self, key: str, *, touch: bool = True) -> base.StoredEntry | None:
        row = await self._read(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE key=?", (key,))
        if row is None:
            return None
        entry = _stored(row)
        if touch:
            now = time.time()
            self._touched[key] = now
            if time.monotonic() - self._flushed_at >= ACCESS_FLUSH_S and self._flushing is None:
                self._flushing = asyncio.get_running_loop().create_task(self._flush())
            entry = replace(entry, last_access=now)
        return entry

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

    async def put(self, entry: base.NewEntry, condition: base.Precondition
                  ) -> tuple[base.StoredEntry, bool]:
        etag = base.entry_etag(entry.manifest_json)

        def op(c: sqlite3.Connection) -> tuple[base.StoredEntry, bool]:
            now = time.time()
            with _transaction(c, immediate=True):
                row = c.execute("SELECT etag, pinned FROM entries WHERE key=?",
                                (entry.key,)).fetchone()
                base.check_precondition(condition, row[0] if row else None)
                c.execute(
                    """INSERT INTO entries (key, manifest, etag, namespace, model, env_digest,
                         hw_digest, size, created_at, updated_at, last_access)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                       ON CONFLICT(key) DO UPDATE SET manifest=excluded.manifest,
                         etag=excluded.etag, namespace=excluded.namespace,
                         model=excluded.model, env_digest=excluded.env_digest,
                         hw_digest=excluded.hw_digest, size=excluded.size,
                         created_at=excluded.created_at, updated_at=excluded.updated_at,
                         last_access=excluded.last_access""",
                    (entry.key, entry.manifest_json, etag, entry.namespace, entry.model,
                     entry.env_digest, entry.hw_digest, entry.size, entry.created_at, now, now))
                c.execute("DELETE FROM entry_blobs WHERE key=?", (entry.key,))
                c.executemany("INSERT INTO entry_blobs (key, digest) VALUES (?, ?)",
                              [(entry.key, d) for d in entry.digests])
            stored = base.StoredEntry(entry.key, entry.namespace, entry.model, entry.digests,
                                 entry.size, entry.created_at, now, now,
                                 bool(row and row[1]), entry.manifest_json, etag)
            return stored, row is None

        return await self._run(op)

    async def list_entries(self, *, namespace: str | None = None, model: str | None = None,
                           env_digest: str | None = None, hw_digest: str | None = None,
                           limit: int) -> list[base.StoredEntry]:
        where, args = _filters(namespace=namespace, model=model, env_digest=env_digest,
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

    async def largest_entries(self, *, namespace: str | None, limit: int) -> list[base.EntryInfo]:
        where, args = _filters(namespace=namespace)
        sql = f"SELECT {INFO_COLUMNS} FROM entries{where} ORDER BY size DESC, key LIMIT ?"
        return await self._run(lambda c: [_info(r) for r in c.execute(
            sql, (*args, limit)).fetchall()])

    async def usage(self, namespace: str | None = None) -> tuple[int, int]:
        where, args = _filters(namespace=namespace)
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
        # every unpinned entry per statement, 0.5 s per batch at a million entries)
        extra = " AND +pinned=0" if unless_pinned else ""
        return await self._write_batches(_batches(keys), lambda c, part: c.execute(
            f"DELETE FROM entries WHERE key IN ({_marks(part)}){extra}", part).rowcount)

    async def _write_batches(self, parts: list[list[str]],
                             op: Callable[[sqlite3.Connection, list[str]], int]) -> int:
        """`op` on each part in a transaction of its own, synced to disk once for them all.

        A commit at synchronous=FULL is an fsync of the WAL. A GC evicting 100,000 entries
        made hundreds while it wrote 150 MB/s, and lookups on the same disk waited up to half
        a second for a page (scale_bench at 1M entries). So every commit but the last is at
        NORMAL (a power loss could undo one, never corrupt it), and the last at FULL: its
        fsync covers every frame before it (a checkpoint between them syncs what it moves),
        so when this returns all of it is durable, as eviction needs before it deletes the
        blob files of the entries it removed. The setting is restored within the same hold
        of the connection lock: no other write ever commits at NORMAL."""
        done = 0
        for i, part in enumerate(parts):
            def run(c: sqlite3.Connection, part: list[str] = part,
                    relaxed: bool = i < len(parts) - 1) -> int:
                if relaxed:
                    c.execute("PRAGMA synchronous=NORMAL")
                try:
                    with _transaction(c, immediate=True):
                        return op(c, part)
                finally:
                    if relaxed:
                        c.execute("PRAGMA synchronous=FULL")

            done += await self._run(run)
        return done

    async def set_pinned(self, key: str, pinned: bool) -> bool:
        return await self._run(lambda c: c.execute(
            "UPDATE entries SET pinned=? WHERE key=?", (int(pinned), key)).rowcount > 0)

    async def lru_entries(self, limit: int, *, namespace: str | None = None,
                          after: base.EntryInfo | None = None) -> list[base.EntryInfo]:
        pending, self._touched = self._touched, {}
        where = " AND namespace=?" if namespace is not None else ""
        args: tuple[Any, ...] = (namespace,) if namespace is not None else ()
        if after is not None:  # keyset paging: OFFSET would evaluate every row it skips
            where += " AND (last_access, key) > (?, ?)"
            args += (after.last_access, after.key)

        def op(c: sqlite3.Connection) -> list[base.EntryInfo]:
            _flush_access(c, pending)
            return [_info(r) for r in c.execute(
                f"SELECT {INFO_COLUMNS} FROM entries WHERE pinned=0{where} "
                "ORDER BY last_access, key LIMIT ?", (*args, limit)).fetchall()]

        return await self._run(op)

    # -- blobs --------------------------------------------------------------------------
    async def record_blob(self, digest: str, size: int, namespace: str) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            now = time.time()
            with _transaction(c, immediate=True):
                c.execute("""INSERT INTO blobs (digest, size, created_at, touched_at)
                             VALUES (?, ?, ?, ?)
                             ON CONFLICT(digest) DO UPDATE SET touched_at=excluded.touched_at""",
                          (digest, size, now, now))
                return c.execute("INSERT OR IGNORE INTO blob_owners (namespace, digest) "
                                 "VALUES (?, ?)", (namespace, digest)).rowcount > 0

        return await self._run(op)

    async def stored_bytes(self) -> int:
        row = await self._read("SELECT bytes FROM blob_total WHERE id=1", ())
        return int(row[0]) if row else 0

    async def pending_bytes(self, namespace: str) -> int:
        return await self._run(lambda c: int(c.execute(
            """SELECT COALESCE(SUM(b.size), 0) FROM blob_owners o JOIN blobs b USING (digest)
               WHERE o.namespace=? AND NOT EXISTS
                 (SELECT 1 FROM entry_blobs e WHERE e.digest=o.digest)""",
            (namespace,)).fetchone()[0]))

    async def recorded_digests(self) -> set[str]:
        return await self._run(lambda c: {d for (d,) in c.execute("SELECT digest FROM blobs")})

    async def blob_record(self, digest: str) -> base.BlobRecord | None:
        row = await self._read("SELECT digest, size, touched_at FROM blobs WHERE digest=?",
                               (digest,))
        return base.BlobRecord(*row) if row else None

    async def reference_counts(self, digests: list[str]) -> dict[str, int]:
        counts = dict.fromkeys(digests, 0)
        for part in _batches(digests):
            counts.update(await self._rows(
                f"SELECT digest, COUNT(*) FROM entry_blobs WHERE digest IN ({_marks(part)}) "
                "GROUP BY digest", part))
        return counts

    async def blob_records_of(self, digests: list[str]) -> dict[str, base.BlobRecord]:
        found: dict[str, base.BlobRecord] = {}
        for part in _batches(digests):
            rows = await self._rows(
                f"SELECT digest, size, touched_at FROM blobs WHERE digest IN ({_marks(part)})",
                part)
            found.update((r[0], base.BlobRecord(*r)) for r in rows)
        return found

    async def _rows(self, sql: str, args: Sequence[Any]) -> list[Any]:
        """All rows of one read on the writer connection (in its thread)."""
        return await self._run(lambda c: c.execute(sql, args).fetchall())

    async def unreferenced_blobs(self) -> list[base.BlobRecord]:
        """From the index of blobs no entry names (REFS_SCHEMA), in pages of SCAN_PAGE, each
        one short read on the writer: cost follows what GC may collect, not the store."""
        found: list[base.BlobRecord] = []
        after = ""
        while True:
            rows = await self._rows(
                "SELECT digest, size, touched_at FROM blobs INDEXED BY blobs_unreferenced "
                "WHERE refs = 0 AND digest > ? ORDER BY digest LIMIT ?", (after, SCAN_PAGE))
            found += [base.BlobRecord(*row) for row in rows]
            if len(rows) < SCAN_PAGE:
                return found
            after = rows[-1][0]

    async def touch_blobs(self, digests: list[str]) -> None:
        now = time.time()
        await self._write(lambda c: c.executemany(
            "UPDATE blobs SET touched_at=? WHERE digest=?", [(now, d) for d in digests]))

    async def forget_blobs(self, digests: list[str]) -> None:
        def op(c: sqlite3.Connection, part: list[str]) -> int:
            c.execute(f"DELETE FROM blob_owners WHERE digest IN ({_marks(part)})", part)
            return c.execute(f"DELETE FROM blobs WHERE digest IN ({_marks(part)})",
                             part).rowcount

        await self._write_batches(_batches(digests), op)

    async def owns_blob(self, namespace: str, digest: str) -> bool:
        return await self._read("SELECT 1 FROM blob_owners WHERE namespace=? AND digest=?",
                                (namespace, digest)) is not None

    # -- tokens -------------------------------------------------------------------------
    async def put_token(self, token: base.TokenRecord) -> None:
        await self._write(lambda c: c.execute(
            f"INSERT INTO tokens ({TOKEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (token.token_id, token.name, token.token_hash, ",".join(token.scopes),
             token.namespace, token.created_at, int(token.revoked), token.expires_at)))

    async def get_token(self, token_id: str) -> base.TokenRecord | None:
        row = await self._read(f"SELECT {TOKEN_COLUMNS} FROM tokens WHERE token_id=?",
                               (token_id,))
        return _token(row) if row else None

    async def list_tokens(self) -> list[base.TokenRecord]:
        return await self._run(lambda c: [_token(r) for r in c.execute(
            f"SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at").fetchall()])

    async def revoke_token(self, token_id: str) -> bool:
        return await self._run(lambda c: c.execute(
            "UPDATE tokens SET revoked=1 WHERE token_id=?", (token_id,)).rowcount > 0)

    # -- events -------------------------------------------------------------------------
    async def add_event(self, namespace: str, event: Event) -> None:
        now = time.time()
        counters = base.event_counters(event)
        columns = ", ".join(base.COUNTERS)
        marks = ", ".join("?" * len(base.COUNTERS))
        values = tuple(counters[c] for c in base.COUNTERS)
        hour = base.event_hour(event, now)
        day = hour // base.DAY * base.DAY

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c, immediate=True):
                c.execute("INSERT INTO events (received_at, namespace, event) VALUES (?, ?, ?)",
                          (now, namespace, event.to_json()))
                model = _admitted_model(c, namespace, event.model)
                for table, period in (("rollup_hourly", hour), ("rollup_daily", day)):
                    c.execute(f"""INSERT INTO {table} VALUES (?, ?, ?, {marks})
                                  ON CONFLICT DO UPDATE SET {_UPSERT}""",
                              (namespace, period, model, *values))
                c.execute(f"""INSERT INTO rollup_total (namespace, model, {columns})
                              VALUES (?, ?, {marks}) ON CONFLICT DO UPDATE SET {_UPSERT}""",
                          (namespace, model, *values))
                if event.outcome not in ("hit", "fallback"):
                    for table, column, period in (("miss_reasons", "hour", hour),
                                                  ("miss_reasons_daily", "day", day)):
                        row = (namespace, period, model, event.outcome, event.reason[:200])
                        c.execute(f"""INSERT INTO {table} VALUES (?, ?, ?, ?, ?, 1)
                                      ON CONFLICT DO UPDATE SET count=count+1""",
                                  _admitted_reason(c, table, column, row))

        await self._run(op)

    async def stats(self, *, namespace: str | None, since: float | None = None
                    ) -> list[base.ModelStats]:
        sums = ", ".join(f"TOTAL({c})" for c in base.COUNTERS)
        where, args = _filters(namespace=namespace)
        if since is None:
            sql = f"SELECT namespace, model, {sums} FROM rollup_total{where} " \
                  "GROUP BY namespace, model"
        else:
            rows, args = _windowed("namespace, model, " + ", ".join(base.COUNTERS),
                                   "rollup", namespace, base.window(since, time.time()))
            sql = f"SELECT namespace, model, {sums} FROM ({rows}) GROUP BY namespace, model"
        found = await self._rows(sql, args)
        return _model_stats(found)

    async def timeline(self, *, namespace: str | None, since: float,
                       daily: bool = False) -> list[base.TimelineSlot]:
        rows, args = _windowed("runs, hit + fallback AS warm, saved_s, tts_s, tts_n", "rollup",
                               namespace, base.window(since, time.time(), days=daily))
        found = await self._rows(
            "SELECT period, TOTAL(runs), TOTAL(warm), TOTAL(saved_s), TOTAL(tts_s), "
            f"TOTAL(tts_n) FROM ({rows}) GROUP BY period ORDER BY period", args)
        return [base.TimelineSlot(int(h), int(r), int(w), s, t, int(n))
                for h, r, w, s, t, n in found]

    async def top_misses(self, *, namespace: str | None, since: float,
                         limit: int) -> list[base.MissReason]:
        rows, args = _windowed("model, outcome, reason, count", "miss_reasons", namespace,
                               base.window(since, time.time()))
        found = await self._rows(
            f"SELECT model, outcome, reason, SUM(count) AS n FROM ({rows}) "
            "GROUP BY model, outcome, reason ORDER BY n DESC, model LIMIT ?", (*args, limit))
        return [base.MissReason(m, o, r, int(n)) for m, o, r, n in found]

    async def prune_events(self, *, raw_before: float, rollups_before: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            with _transaction(c, immediate=True):
                n = c.execute("DELETE FROM events WHERE received_at < ?",
                              (raw_before,)).rowcount
                for table, period in (("rollup_hourly", "hour"), ("miss_reasons", "hour"),
                                      ("rollup_daily", "day"), ("miss_reasons_daily", "day")):
                    c.execute(f"DELETE FROM {table} WHERE {period} < ?",
                              (base.hour_of(rollups_before) // base.DAY * base.DAY
                               if period == "day" else rollups_before,))
                return int(n)

        return await self._run(op)

    # -- locks and health ---------------------------------------------------------------
    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            now = time.time()
            with _transaction(c, immediate=True):
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

    async def ping(self, *, write: bool = False) -> None:
        if write:
            await self._write(lambda c: c.execute(
                "INSERT OR REPLACE INTO heartbeat (id, at) VALUES (1, ?)", (time.time(),)))
        else:
            await self._run(lambda c: c.execute("SELECT 1").fetchone())


def _statements(script: str) -> list[str]:
    """The statements of a script whose triggers hold `;` inside BEGIN ... END."""
    out, current = [], ""
    for part in script.split(";"):
        current += part + ";"
        if sqlite3.complete_statement(current):
            if current.strip(" \n;"):
                out.append(current.strip())
            current = ""
    return out


def _flush_access(c: sqlite3.Connection, touched: dict[str, float]) -> None:
    if touched:
        with _transaction(c, immediate=True):
            c.executemany("UPDATE entries SET last_access=MAX(last_access, ?) WHERE key=?",
                          [(t, k) for k, t in touched.items()])


def _filters(**columns: str | None) -> tuple[str, tuple[Any, ...]]:
    """` WHERE a=? AND b=?` for the columns given a value, and their values."""
    given = [(k, v) for k, v in columns.items() if v is not None]
    if not given:
        return "", ()
    return " WHERE " + " AND ".join(f"{k}=?" for k, _ in given), tuple(v for _, v in given)


class _transaction:
    """BEGIN … COMMIT/ROLLBACK on an autocommit connection."""

    def __init__(self, conn: sqlite3.Connection, immediate: bool = False) -> None:
        self.conn = conn
        self.begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute(self.begin)
        return self.conn

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")


TOKEN_COLUMNS = "token_id, name, token_hash, scopes, namespace, created_at, revoked, expires_at"


def _token(row: tuple[Any, ...]) -> base.TokenRecord:
    token_id, name, token_hash, scopes, namespace, created_at, revoked, expires_at = row
    return base.TokenRecord(token_id, name, token_hash, tuple(scopes.split(",")), namespace,
                            created_at, bool(revoked), expires_at)


def _admitted_model(c: sqlite3.Connection, namespace: str, model: str) -> str:
    """`model`, or OTHER_MODELS once the namespace's rollups hold MAX_MODELS names."""
    if c.execute("SELECT 1 FROM rollup_total WHERE namespace=? AND model=?",
                 (namespace, model)).fetchone():
        return model
    known = c.execute("SELECT COUNT(*) FROM rollup_total WHERE namespace=?",
                      (namespace,)).fetchone()[0]
    return model if known < base.MAX_MODELS else base.OTHER_MODELS


def _admitted_reason(c: sqlite3.Connection, table: str, column: str,
                     row: tuple[str, int, str, str, str]) -> tuple[str, int, str, str, str]:
    """The miss row to count: `row`, or its OTHER_REASONS row once the namespace's period
    holds MAX_REASONS rows (both counts read the primary key's prefix)."""
    namespace, period, model, outcome, _ = row
    if c.execute(f"SELECT 1 FROM {table} WHERE namespace=? AND {column}=? AND model=? "
                 "AND outcome=? AND reason=?", row).fetchone():
        return row
    known = c.execute(f"SELECT COUNT(*) FROM {table} WHERE namespace=? AND {column}=?",
                      (namespace, period)).fetchone()[0]
    return row if known < base.MAX_REASONS else (namespace, period, model, outcome,
                                                 base.OTHER_REASONS)


def _windowed(columns: str, table: str, namespace: str | None,
              window: base.Window) -> tuple[str, tuple[Any, ...]]:
    """The rows of `table`'s hourly and daily rollups that add up to `window` (one UNION ALL
    with a `period` column), and its parameters. `table` is a prefix: rollup or
    miss_reasons, whose hourly tables are rollup_hourly and miss_reasons."""
    hourly = "rollup_hourly" if table == "rollup" else table
    ns = "namespace=? AND " if namespace is not None else ""
    ns_args: tuple[Any, ...] = (namespace,) if namespace is not None else ()
    sql = (f"SELECT hour AS period, {columns} FROM {hourly} "
           f"WHERE {ns}((hour >= ? AND hour < ?) OR hour >= ?) UNION ALL "
           f"SELECT day AS period, {columns} FROM {table}_daily "
           f"WHERE {ns}day >= ? AND day < ?")
    return sql, (*ns_args, window.first_hour, window.day_start, window.day_end,
                 *ns_args, window.day_start, window.day_end)


def _batches(items: list[str]) -> list[list[str]]:
    """`items` in chunks that fit one statement's parameters."""
    return [items[i:i + BATCH] for i in range(0, len(items), BATCH)]


def _marks(part: list[str]) -> str:
    return ",".join("?" * len(part))


def _info(row: tuple[Any, ...]) -> base.EntryInfo:
    key, namespace, model, size, created_at, updated_at, last_access, pinned, digests = row[:9]
    return base.EntryInfo(key, namespace, model, tuple(digests.split(",")) if digests else (),
                     int(size), created_at, updated_at, last_access, bool(pinned))


def _stored(row: tuple[Any, ...]) -> base.StoredEntry:
    info = _info(row)
    return base.StoredEntry(**vars(info), manifest_json=bytes(row[9]), etag=row[10])


def _model_stats(rows: list[tuple[Any, ...]]) -> list[base.ModelStats]:
    out = []
    for namespace, model, *sums in rows:
        s = base.ModelStats(namespace, model)
        s.add(dict(zip(base.COUNTERS, sums, strict=True)))
        out.append(s)
    return sorted(out, key=lambda s: (-s.runs, s.namespace, s.model))

