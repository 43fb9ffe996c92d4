"""The SQLite index's connections, and the helpers each of its parts runs statements with.

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

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from anyio import to_thread

from megacache_server.errors import ServiceUnavailable
from megacache_server.store.index.sqlite import schema

T = TypeVar("T")
BATCH = 500
"""Keys or digests per statement in batched reads and deletes."""
SCAN_PAGE = 5000
"""Rows per page when a scan crosses the whole store."""


class SqliteConnection:
    """The file, its writer and reader connections, and the ways to run statements on them."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._lock = threading.Lock()

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
        with transaction(conn, immediate=True):
            schema.create(conn, self.path)
        reader = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=0.05,
                                 isolation_level=None, check_same_thread=False)
        self._conn, self._reader = conn, reader

    async def close(self) -> None:
        if self._conn is not None:
            await self._run(lambda c: c.close())
            self._conn = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    async def ping(self, *, write: bool = False) -> None:
        if write:
            await self._write(lambda c: c.execute(
                "INSERT OR REPLACE INTO heartbeat (id, at) VALUES (1, ?)", (time.time(),)))
        else:
            await self._run(lambda c: c.execute("SELECT 1").fetchone())

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
                        # thread it races the connection (sqlite3.InterfaceError)
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

    async def _rows(self, sql: str, args: Sequence[Any]) -> list[Any]:
        """All rows of one read on the writer connection (in its thread)."""
        return await self._run(lambda c: c.execute(sql, args).fetchall())

    async def _write_batches(self, parts: list[list[str]],
                             op: Callable[[sqlite3.Connection, list[str]], int]) -> int:
        """`op` on each part in a transaction of its own, synced to disk once for them all.

        A commit at synchronous=FULL is an fsync of the WAL. A GC evicting 100,000 entries
        would make hundreds while it writes, and lookups on the same disk would wait behind
        them for a page, up to half a second on a large store. So every commit but the last
        is at NORMAL (a power loss could undo one, never corrupt it), and the last at FULL: its
        fsync covers every frame before it (a checkpoint between them syncs what it moves),
        so when this returns all of it is durable, as eviction needs before it deletes the
        blob files of the entries it removed. The setting is restored within the same hold
        of the connection lock: no other write ever commits at NORMAL."""
        done = 0
        for i, part in enumerate(parts):
            def run(c: sqlite3.Connection, part: list[str] = part,
                    relaxed: bool = i < len(parts) - 1) -> int:
                with unsynced(c) if relaxed else contextlib.nullcontext(c), \
                        transaction(c, immediate=True):
                    return op(c, part)

            done += await self._run(run)
        return done


@contextlib.contextmanager
def unsynced(c: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Commits made within are at synchronous=NORMAL (in WAL mode: no fsync; a power loss
    may undo them, never corrupt anything); FULL again after, under the same hold of the
    connection lock, so no other write commits unsynced."""
    c.execute("PRAGMA synchronous=NORMAL")
    try:
        yield c
    finally:
        c.execute("PRAGMA synchronous=FULL")


class transaction:
    """BEGIN … COMMIT/ROLLBACK on an autocommit connection."""

    def __init__(self, conn: sqlite3.Connection, immediate: bool = False) -> None:
        self.conn = conn
        self.begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute(self.begin)
        return self.conn

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")


def filters(**columns: str | None) -> tuple[str, tuple[Any, ...]]:
    """` WHERE a=? AND b=?` for the columns given a value, and their values."""
    given = [(k, v) for k, v in columns.items() if v is not None]
    if not given:
        return "", ()
    return " WHERE " + " AND ".join(f"{k}=?" for k, _ in given), tuple(v for _, v in given)


def batches(items: list[str]) -> list[list[str]]:
    """`items` in chunks that fit one statement's parameters."""
    return [items[i:i + BATCH] for i in range(0, len(items), BATCH)]


def marks(part: list[str]) -> str:
    return ",".join("?" * len(part))
