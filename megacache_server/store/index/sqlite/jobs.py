"""JobStore and ClaimStore on SQLite: a row per job attempt's resolution of a key, a row per
publish claim, and `held_blobs`, each blob a live resolution names with the latest expiry of
those naming it (what GC asks, without reading resolutions).

Every decision (first resolution wins, a claim is free or taken, a namespace has room for
another record) is made inside `BEGIN IMMEDIATE`, so every process on the file agrees. A
rank asking again while its resolution has more than half its life left is answered from
the reader without a write: a thousand ranks asking at once do not queue behind SQLite's
single writer.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from megacache_server.store.index.protocols import jobs
from megacache_server.store.index.protocols.entries import StoredEntry
from megacache_server.store.index.sqlite.connection import (
    SqliteConnection,
    batches,
    marks,
    transaction,
)

_COLUMNS = "manifest, etag, entry_namespace, digests, resolved_at, expires_at"
_SELECT = (f"SELECT {_COLUMNS} FROM resolutions "
           "WHERE namespace=? AND job=? AND attempt=? AND key=?")


class SqliteJobs(SqliteConnection, jobs.JobStore, jobs.ClaimStore):
    async def resolve(self, namespace: str, job: str, attempt: int, key: str,
                      candidate: StoredEntry | None, ttl_s: float, now: float, *,
                      max_records: int | None = None) -> jobs.Resolution:
        ttl_s = jobs.clamp_ttl(ttl_s, jobs.MAX_RESOLUTION_TTL_S)
        ids = (namespace, job, attempt, key)
        row = await self._read(_SELECT, ids)
        if row is not None and row[5] >= now + ttl_s / 2:
            return _resolution(ids, row)

        def op(c: sqlite3.Connection) -> jobs.Resolution:
            with transaction(c, immediate=True):
                row = c.execute(_SELECT, ids).fetchone()
                if row is not None and row[5] > now:  # live: renew, never shorten
                    expires = max(row[5], now + ttl_s)
                    c.execute("UPDATE resolutions SET expires_at=? WHERE namespace=? AND "
                              "job=? AND attempt=? AND key=?", (expires, *ids))
                    row = (*row[:5], expires)
                else:  # absent or expired: this caller's candidate is the answer
                    _require_room(c, namespace, now, max_records)
                    row = (candidate.manifest_json if candidate else b"",
                           candidate.etag if candidate else "",
                           candidate.namespace if candidate else "",
                           ",".join(candidate.digests) if candidate else "",
                           now, now + ttl_s)
                    c.execute(f"INSERT OR REPLACE INTO resolutions (namespace, job, attempt, "
                              f"key, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                              (*ids, *row))
                digests = [d for d in row[3].split(",") if d]
                c.executemany("INSERT INTO held_blobs (digest, until) VALUES (?, ?) "
                              "ON CONFLICT(digest) DO UPDATE SET "
                              "until=max(until, excluded.until)",
                              [(d, row[5]) for d in digests])
                return _resolution(ids, row)

        return await self._run(op)

    async def held_blobs(self, digests: list[str], now: float) -> set[str]:
        held: set[str] = set()
        for part in batches(digests):
            rows = await self._rows(f"SELECT digest FROM held_blobs WHERE until > ? "
                                    f"AND digest IN ({marks(part)})", (now, *part))
            held.update(d for (d,) in rows)
        return held

    async def prune_jobs(self, now: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            with transaction(c, immediate=True):
                gone = c.execute("DELETE FROM resolutions WHERE expires_at <= ?",
                                 (now,)).rowcount
                gone += c.execute("DELETE FROM claims WHERE expires_at <= ?", (now,)).rowcount
                c.execute("DELETE FROM held_blobs WHERE until <= ?", (now,))
                return int(gone)

        return await self._run(op)

    async def claim(self, namespace: str, key: str, holder: str, lease_s: float,
                    now: float, *, max_records: int | None = None) -> jobs.Claim:
        lease_s = jobs.clamp_ttl(lease_s, jobs.MAX_CLAIM_LEASE_S)

        def op(c: sqlite3.Connection) -> jobs.Claim:
            with transaction(c, immediate=True):
                row = c.execute("SELECT holder, expires_at FROM claims WHERE namespace=? "
                                "AND key=?", (namespace, key)).fetchone()
                if row is not None and row[0] != holder and row[1] > now:
                    return jobs.Claim(False, row[0], row[1])
                if row is None or row[1] <= now:  # a new claim, not a renewal
                    _require_room(c, namespace, now, max_records)
                c.execute("INSERT OR REPLACE INTO claims (namespace, key, holder, expires_at) "
                          "VALUES (?, ?, ?, ?)", (namespace, key, holder, now + lease_s))
                return jobs.Claim(True, holder, now + lease_s)

        return await self._run(op)

    async def release(self, namespace: str, key: str, holder: str, now: float) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            with transaction(c, immediate=True):
                row = c.execute("SELECT holder, expires_at FROM claims WHERE namespace=? "
                                "AND key=?", (namespace, key)).fetchone()
                if row is not None and row[0] != holder and row[1] > now:
                    return False
                c.execute("DELETE FROM claims WHERE namespace=? AND key=?", (namespace, key))
                return True

        return await self._run(op)


def _require_room(c: sqlite3.Connection, namespace: str, now: float,
                  cap: int | None) -> None:
    """Refuse a new record once the namespace's live resolutions and claims reach `cap`."""
    if cap is None:
        return
    live = c.execute("SELECT (SELECT COUNT(*) FROM resolutions WHERE namespace = ? AND "
                     "expires_at > ?) + (SELECT COUNT(*) FROM claims WHERE namespace = ? "
                     "AND expires_at > ?)", (namespace, now, namespace, now)).fetchone()[0]
    if live >= cap:
        raise jobs.records_full(namespace, cap)


def _resolution(ids: tuple[str, str, int, str], row: tuple[Any, ...]) -> jobs.Resolution:
    return jobs.Resolution(*ids, manifest_json=bytes(row[0]), etag=row[1], entry_namespace=row[2],
                           digests=tuple(d for d in row[3].split(",") if d),
                           resolved_at=row[4], expires_at=row[5])
