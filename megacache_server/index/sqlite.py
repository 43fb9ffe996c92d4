"""Index in SQLite (WAL): the embedded default, safe across several uvicorn workers.

Each process holds one connection guarded by a lock and used from worker threads;
processes coordinate through SQLite's own locking (WAL + busy timeout). Conditional
writes run inside `BEGIN IMMEDIATE` so check-then-write is atomic across processes.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from anyio import to_thread

from megacache_client.events import Event
from megacache_server.errors import ServiceUnavailable
from megacache_server.index.base import (
    BlobRecord,
    Index,
    ModelStats,
    Precondition,
    StoredEntry,
    TokenRecord,
    aggregate_stats,
    check_precondition,
    entry_etag,
)

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key          TEXT PRIMARY KEY,
    manifest     BLOB NOT NULL,
    etag         TEXT NOT NULL,
    model        TEXT NOT NULL,
    env_digest   TEXT NOT NULL,
    hw_digest    TEXT NOT NULL,
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL,
    last_access  REAL NOT NULL,
    pinned       INTEGER NOT NULL DEFAULT 0,
    namespace    TEXT NOT NULL DEFAULT 'default'
);
CREATE INDEX IF NOT EXISTS entries_by_model ON entries (model, created_at DESC);
CREATE TABLE IF NOT EXISTS entry_blobs (
    key    TEXT NOT NULL REFERENCES entries(key) ON DELETE CASCADE,
    digest TEXT NOT NULL,
    PRIMARY KEY (key, digest)
);
CREATE INDEX IF NOT EXISTS entry_blobs_by_digest ON entry_blobs (digest);
CREATE TABLE IF NOT EXISTS events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at  REAL NOT NULL,
    model       TEXT NOT NULL,
    key         TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    compile_s   REAL NOT NULL,
    saved_s     REAL NOT NULL,
    bytes_down  INTEGER NOT NULL,
    bytes_up    INTEGER NOT NULL,
    event       BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_time ON events (created_at);
CREATE TABLE IF NOT EXISTS blobs (
    digest      TEXT PRIMARY KEY,
    size        INTEGER NOT NULL,
    created_at  REAL NOT NULL,
    touched_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blob_owners (
    namespace  TEXT NOT NULL,
    digest     TEXT NOT NULL,
    PRIMARY KEY (namespace, digest)
);
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
CREATE INDEX IF NOT EXISTS entries_by_access ON entries (pinned, last_access);
"""

ACCESS_FLUSH_S = 1.0
ENTRY_COLUMNS = "key, manifest, etag, created_at, updated_at, last_access, pinned"


class SqliteIndex(Index):
    name = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._owner = uuid.uuid4().hex
        self._touched: dict[str, float] = {}
        self._flushed_at = time.monotonic()

    async def open(self) -> None:
        await to_thread.run_sync(self._open_sync)

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            self.path, timeout=30, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is fsynced before it returns, so an acknowledged entry survives a
        # power loss (NORMAL in WAL mode may lose the last commits); blobs are fsynced too
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        with _transaction(conn, immediate=True):
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            # data dirs from 0.1.0 development builds
            blob_columns = {r[1] for r in conn.execute("PRAGMA table_info(blobs)")}
            if "touched_at" not in blob_columns:
                conn.execute("ALTER TABLE blobs ADD COLUMN touched_at REAL NOT NULL DEFAULT 0")
            entry_columns = {r[1] for r in conn.execute("PRAGMA table_info(entries)")}
            if "namespace" not in entry_columns:
                conn.execute("ALTER TABLE entries ADD COLUMN namespace TEXT NOT NULL "
                             "DEFAULT 'default'")
            token_columns = {r[1] for r in conn.execute("PRAGMA table_info(tokens)")}
            if "expires_at" not in token_columns:
                conn.execute("ALTER TABLE tokens ADD COLUMN expires_at REAL")
        self._conn = conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._run(self._flush_access)
            await self._run(lambda c: c.close())
            self._conn = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            if self._conn is None:
                raise ServiceUnavailable("index is not open", code="index_unavailable")
            with self._lock:
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
                        f"index error: {exc}", code="index_unavailable"
                    ) from exc

        return await to_thread.run_sync(call)

    async def get(self, key: str, *, touch: bool = True) -> StoredEntry | None:
        def op(c: sqlite3.Connection) -> StoredEntry | None:
            row = c.execute(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE key=?", (key,)).fetchone()
            if row is None:
                return None
            entry = _entry(row)
            if touch:
                now = time.time()
                self._touched[key] = now
                if time.monotonic() - self._flushed_at >= ACCESS_FLUSH_S:
                    self._flush_access(c)
                entry = replace(entry, last_access=now)
            return entry

        return await self._run(op)

    def _flush_access(self, c: sqlite3.Connection) -> None:
        """Write buffered last-access times: one transaction a second, not one per lookup.

        A lookup is the hottest request (every rank of every job start); a write each
        would serialize them on SQLite's single writer across all workers.
        """
        if self._touched:
            with _transaction(c, immediate=True):
                c.executemany("UPDATE entries SET last_access=MAX(last_access, ?) WHERE key=?",
                              [(t, k) for k, t in self._touched.items()])
            self._touched.clear()
        self._flushed_at = time.monotonic()

    async def put(
        self,
        key: str,
        manifest_json: bytes,
        *,
        model: str,
        env_digest: str,
        hw_digest: str,
        blob_digests: list[str],
        created_at: float,
        condition: Precondition,
        namespace: str = "default",
    ) -> tuple[StoredEntry, bool]:
        etag = entry_etag(manifest_json)

        def op(c: sqlite3.Connection) -> tuple[StoredEntry, bool]:
            now = time.time()
            with _transaction(c, immediate=True):
                row = c.execute("SELECT etag FROM entries WHERE key=?", (key,)).fetchone()
                check_precondition(condition, row[0] if row else None)
                c.execute(
                    """INSERT INTO entries (key, manifest, etag, model, env_digest, hw_digest,
                                            created_at, updated_at, last_access, namespace)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                       ON CONFLICT(key) DO UPDATE SET manifest=excluded.manifest,
                         namespace=excluded.namespace,
                         etag=excluded.etag, model=excluded.model,
                         env_digest=excluded.env_digest, hw_digest=excluded.hw_digest,
                         created_at=excluded.created_at, updated_at=excluded.updated_at,
                         last_access=excluded.last_access""",
                    (key, manifest_json, etag, model, env_digest, hw_digest, created_at, now, now,
                     namespace),
                )
                c.execute("DELETE FROM entry_blobs WHERE key=?", (key,))
                c.executemany(
                    "INSERT INTO entry_blobs (key, digest) VALUES (?, ?)",
                    [(key, d) for d in blob_digests],
                )
            pinned = c.execute("SELECT pinned FROM entries WHERE key=?", (key,)).fetchone()[0]
            entry = StoredEntry(key, manifest_json, etag, created_at, now, now, bool(pinned))
            return entry, row is None

        return await self._run(op)

    async def list_entries(
        self, *, model: str | None, env_digest: str | None, hw_digest: str | None, limit: int,
        namespace: str | None = None,
    ) -> list[StoredEntry]:
        where: list[str] = []
        args: list[str | int] = []
        for column, value in (("model", model), ("env_digest", env_digest),
                              ("hw_digest", hw_digest), ("namespace", namespace)):
            if value is not None:
                where.append(f"{column}=?")
                args.append(value)
        sql = f"SELECT {ENTRY_COLUMNS} FROM entries"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, key LIMIT ?"
        args.append(limit)
        return await self._run(lambda c: [_entry(r) for r in c.execute(sql, args).fetchall()])

    async def entry_count(self) -> int:
        return await self._run(
            lambda c: int(c.execute("SELECT COUNT(*) FROM entries").fetchone()[0]))

    async def delete(self, key: str) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            with _transaction(c, immediate=True):
                return c.execute("DELETE FROM entries WHERE key=?", (key,)).rowcount > 0

        return await self._run(op)

    async def record_blob(self, digest: str, size: int) -> None:
        now = time.time()
        await self._run(lambda c: c.execute(
            """INSERT INTO blobs (digest, size, created_at, touched_at) VALUES (?, ?, ?, ?)
               ON CONFLICT(digest) DO UPDATE SET touched_at=excluded.touched_at""",
            (digest, size, now, now),
        ))

    async def set_pinned(self, key: str, pinned: bool) -> bool:
        return await self._run(lambda c: c.execute(
            "UPDATE entries SET pinned=? WHERE key=?", (int(pinned), key)).rowcount > 0)

    async def lru_entries(self, limit: int) -> list[StoredEntry]:
        def op(c: sqlite3.Connection) -> list[StoredEntry]:
            self._flush_access(c)
            return [_entry(r) for r in c.execute(
                f"SELECT {ENTRY_COLUMNS} FROM entries WHERE pinned=0 "
                "ORDER BY last_access, key LIMIT ?", (limit,)).fetchall()]

        return await self._run(op)

    async def blob_records(self) -> list[BlobRecord]:
        return await self._run(lambda c: [BlobRecord(*r) for r in c.execute(
            "SELECT digest, size, touched_at FROM blobs ORDER BY digest").fetchall()])

    async def blob_record(self, digest: str) -> BlobRecord | None:
        row = await self._run(lambda c: c.execute(
            "SELECT digest, size, touched_at FROM blobs WHERE digest=?", (digest,)).fetchone())
        return BlobRecord(*row) if row else None

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
        await self._run(lambda c: c.execute("DELETE FROM locks WHERE name=? AND owner=?",
                                            (name, self._owner)))

    async def referenced(self, digests: list[str]) -> set[str]:
        def op(c: sqlite3.Connection) -> set[str]:
            found: set[str] = set()
            for i in range(0, len(digests), 500):
                part = digests[i:i + 500]
                marks = ",".join("?" * len(part))
                found.update(r[0] for r in c.execute(
                    f"SELECT DISTINCT digest FROM entry_blobs WHERE digest IN ({marks})", part))
            return found

        return await self._run(op)

    async def touch_blobs(self, digests: list[str]) -> None:
        now = time.time()
        await self._run(lambda c: c.executemany(
            "UPDATE blobs SET touched_at=? WHERE digest=?", [(now, d) for d in digests]))

    async def forget_blob(self, digest: str) -> None:
        await self._run(lambda c: c.execute("DELETE FROM blobs WHERE digest=?", (digest,)))

    async def stored_bytes(self) -> int:
        return await self._run(
            lambda c: int(c.execute("SELECT COALESCE(SUM(size), 0) FROM blobs").fetchone()[0])
        )

    async def own_blob(self, namespace: str, digest: str) -> bool:
        return await self._run(lambda c: c.execute(
            "INSERT OR IGNORE INTO blob_owners (namespace, digest) VALUES (?, ?)",
            (namespace, digest)).rowcount > 0)

    async def owns_blob(self, namespace: str, digest: str) -> bool:
        return await self._run(lambda c: c.execute(
            "SELECT 1 FROM blob_owners WHERE namespace=? AND digest=?",
            (namespace, digest)).fetchone() is not None)

    async def put_token(self, token: TokenRecord) -> None:
        await self._run(lambda c: c.execute(
            "INSERT INTO tokens (token_id, name, token_hash, scopes, namespace, created_at, "
            "revoked, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (token.token_id, token.name, token.token_hash, ",".join(token.scopes),
             token.namespace, token.created_at, int(token.revoked), token.expires_at)))

    async def get_token(self, token_id: str) -> TokenRecord | None:
        row = await self._run(lambda c: c.execute(
            f"SELECT {TOKEN_COLUMNS} FROM tokens WHERE token_id=?", (token_id,)).fetchone())
        return _token(row) if row else None

    async def list_tokens(self) -> list[TokenRecord]:
        return await self._run(lambda c: [_token(r) for r in c.execute(
            f"SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at").fetchall()])

    async def revoke_token(self, token_id: str) -> bool:
        return await self._run(lambda c: c.execute(
            "UPDATE tokens SET revoked=1 WHERE token_id=?", (token_id,)).rowcount > 0)

    async def add_event(self, event: Event) -> None:
        await self._run(lambda c: c.execute(
            """INSERT INTO events (created_at, model, key, outcome, compile_s, saved_s,
                                   bytes_down, bytes_up, event) VALUES (?,?,?,?,?,?,?,?,?)""",
            (event.created_at.timestamp(), event.model, event.key, event.outcome,
             event.compile_s, event.saved_s, event.bytes_down, event.bytes_up,
             event.model_dump_json().encode()),
        ))

    async def events_since(self, since: float, limit: int) -> list[Event]:
        rows = await self._run(lambda c: c.execute(
            "SELECT event FROM events WHERE created_at >= ? ORDER BY created_at DESC LIMIT ?",
            (since, limit)).fetchall())
        return [Event.model_validate_json(r[0]) for r in rows]

    async def stats(self, *, since: float | None = None) -> list[ModelStats]:
        def op(c: sqlite3.Connection) -> list[ModelStats]:
            rows = c.execute(
                """SELECT model, outcome, COUNT(*), SUM(compile_s), SUM(saved_s),
                          SUM(bytes_down), SUM(bytes_up)
                   FROM events WHERE created_at >= ? GROUP BY model, outcome""",
                (since or 0.0,),
            ).fetchall()
            return aggregate_stats(rows)

        return await self._run(op)

    async def ping(self) -> None:
        await self._run(lambda c: c.execute("SELECT 1").fetchone())


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


def _token(row: tuple) -> TokenRecord:
    token_id, name, token_hash, scopes, namespace, created_at, revoked, expires_at = row
    return TokenRecord(token_id, name, token_hash, tuple(scopes.split(",")), namespace,
                       created_at, bool(revoked), expires_at)


def _entry(row: tuple) -> StoredEntry:
    key, manifest, etag, created_at, updated_at, last_access, pinned = row
    return StoredEntry(key, bytes(manifest), etag, created_at, updated_at, last_access,
                       bool(pinned))
