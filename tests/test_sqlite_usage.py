"""The SQLite index's running totals (entries and bytes per namespace, stored blob bytes,
entries naming each blob): kept by triggers, filled from existing rows when an older index
is opened, and equal to what a full count of the rows says after every kind of write."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from megacache_server.store.index.base import NewEntry, Precondition
from megacache_server.store.index.sqlite import SqliteIndex


def entry(key: str, namespace: str, size: int) -> NewEntry:
    return NewEntry(key=key, manifest_json=b"{}", namespace=namespace, model="m",
                    env_digest="e", hw_digest="h", digests=(f"d-{key}",), size=size,
                    created_at=1.0)


def counted(path: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """What a full scan says: (entries, bytes) per namespace, and blob bytes."""
    with sqlite3.connect(path) as c:
        usage = {ns: (n, b) for ns, n, b in c.execute(
            "SELECT namespace, COUNT(*), SUM(size) FROM entries GROUP BY namespace")}
        blobs = c.execute("SELECT COALESCE(SUM(size), 0) FROM blobs").fetchone()[0]
    return usage, blobs


async def totals(ix: SqliteIndex, namespaces: list[str]) -> tuple[dict[str, tuple[int, int]],
                                                                  int]:
    usage = {ns: await ix.usage(ns) for ns in namespaces}
    return {ns: u for ns, u in usage.items() if u[0]}, await ix.stored_bytes()


def test_totals_follow_every_write(tmp_path: Path):
    path = tmp_path / "index.sqlite3"

    async def main() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        try:
            await ix.put(entry("k1", "a", 10), Precondition())
            await ix.put(entry("k2", "a", 20), Precondition())
            await ix.put(entry("k1", "b", 5), Precondition())  # replaced: moves namespace
            await ix.record_blob("d1", 100, "a")
            await ix.record_blob("d1", 100, "b")  # known blob: counted once
            await ix.record_blob("d2", 7, "a")
            await ix.delete("k2")
            await ix.forget_blob("d2")
            assert await totals(ix, ["a", "b"]) == counted(path)
            assert await ix.usage() == (1, 5) and await ix.stored_bytes() == 100
        finally:
            await ix.close()

    asyncio.run(main())


def test_totals_are_filled_when_an_older_index_is_opened(tmp_path: Path):
    path = tmp_path / "index.sqlite3"

    async def fill() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        await ix.put(entry("k1", "a", 10), Precondition())
        await ix.put(entry("k2", "b", 30), Precondition())
        await ix.record_blob("d1", 40, "a")
        await ix.close()

    asyncio.run(fill())
    with sqlite3.connect(path) as c:  # the index as a server without the totals left it
        for trigger in ("usage_entry_insert", "usage_entry_delete", "usage_entry_update",
                        "blob_total_insert", "blob_total_delete"):
            c.execute(f"DROP TRIGGER {trigger}")
        c.execute("DROP TABLE usage")
        c.execute("DROP TABLE blob_total")
        c.execute("INSERT INTO blobs (digest, size, created_at, touched_at) "
                  "VALUES ('d2', 2, 0, 0)")

    async def reopen() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        try:
            assert await totals(ix, ["a", "b"]) == counted(path)
            assert await ix.usage() == (2, 40) and await ix.stored_bytes() == 42
        finally:
            await ix.close()

    asyncio.run(reopen())


def test_blob_references_are_counted_when_an_older_index_is_opened(tmp_path: Path):
    """An index from before the reference counts: GC finds its unreferenced blobs by them."""
    path = tmp_path / "index.sqlite3"

    async def fill() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        for digest in ("d-k1", "d-k2", "orphan"):
            await ix.record_blob(digest, 10, "a")
        await ix.put(entry("k1", "a", 10), Precondition())
        await ix.put(entry("k2", "a", 10), Precondition())
        await ix.close()

    asyncio.run(fill())
    with sqlite3.connect(path) as c:  # the index as a server without the counts left it
        for trigger in ("blob_refs_insert", "blob_refs_delete", "blob_refs_recorded"):
            c.execute(f"DROP TRIGGER {trigger}")
        c.execute("DROP INDEX blobs_unreferenced")
        c.execute("ALTER TABLE blobs DROP COLUMN refs")

    async def reopen() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        try:
            assert [b.digest for b in await ix.unreferenced_blobs()] == ["orphan"]
            await ix.delete("k2")
            assert [b.digest for b in await ix.unreferenced_blobs()] == ["d-k2", "orphan"]
        finally:
            await ix.close()

    asyncio.run(reopen())
    with sqlite3.connect(path) as c:
        assert dict(c.execute("SELECT digest, refs FROM blobs")) == {
            "d-k1": 1, "d-k2": 0, "orphan": 0}


def test_bulk_deletes_sync_once_and_leave_the_connection_durable(tmp_path: Path):
    """Eviction's batches commit at synchronous=NORMAL but the last, at FULL (one fsync
    covers them all before the blob files go); no other write ever sees NORMAL."""
    path = tmp_path / "index.sqlite3"

    async def main() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        keys = [f"k{i:05d}" for i in range(1200)]  # three batches of BATCH=500
        for k in keys:
            await ix.put(entry(k, "ns", 1), Precondition())
        assert ix._conn is not None
        seen: list[str] = []
        ix._conn.set_trace_callback(seen.append)
        assert await ix.delete_many(keys, unless_pinned=True) == 1200
        ix._conn.set_trace_callback(None)
        levels, level = [], "FULL"
        for statement in seen:
            if statement.startswith("PRAGMA synchronous="):
                level = statement.split("=")[1]
            elif statement == "COMMIT":
                levels.append(level)
        assert levels == ["NORMAL", "NORMAL", "FULL"]
        assert ix._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert await ix.usage("ns") == (0, 0)
        await ix.close()

    asyncio.run(main())
