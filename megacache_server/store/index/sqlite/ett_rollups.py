"""EttRollupStore on SQLite: a row per (namespace, period, start, model) holding its counters
(`ett_rollups.encode`: its non-zero counters), a row per job holding its contribution,
each roll in one `BEGIN IMMEDIATE` transaction (every worker on the file sees it whole)."""

from __future__ import annotations

import sqlite3
import time

from megacache_server.store.index import rollups
from megacache_server.store.index.ett_rollups import (
    Contribution,
    Counters,
    Roll,
    Vector,
    add,
    decode,
    encode,
    kept_since,
    row_deltas,
    vector,
)
from megacache_server.store.index.protocols.ett_rollups import EttRollupStore, JobKey
from megacache_server.store.index.sqlite.connection import SqliteConnection, transaction, unsynced

MARK = "roll"
MODELS_DAYS = 35
"""The models a namespace's rows name, as its cap counts them: those of its last 35 days
(a read of a month's daily rows, not of 400 days')."""


class SqliteEttRollups(SqliteConnection, EttRollupStore):
    async def ett_contributions(self, jobs: list[JobKey]) -> dict[JobKey, Contribution]:
        def op(c: sqlite3.Connection) -> list[tuple[str, str, str]]:
            out: list[tuple[str, str, str]] = []
            for i in range(0, len(jobs), 400):
                part = jobs[i:i + 400]
                out += c.execute(
                    "SELECT namespace, job, contribution FROM ett_contrib WHERE "
                    f"(namespace, job) IN (VALUES {','.join(['(?, ?)'] * len(part))})",
                    [v for key in part for v in key]).fetchall()
            return out

        rows = await self._run(op) if jobs else []
        return {(ns, job): Contribution.from_json(raw) for ns, job, raw in rows}

    async def roll_ett(self, rolls: list[Roll]) -> int:
        now = time.time()

        def op(c: sqlite3.Connection) -> int:
            done = 0
            with unsynced(c), transaction(c, immediate=True):
                sums: dict[tuple[str, str, str, int], Counters] = {}
                for roll in rolls:
                    row = c.execute("SELECT contribution FROM ett_contrib WHERE namespace=? "
                                    "AND job=?", (roll.namespace, roll.job)).fetchone()
                    stored = Contribution.from_json(row[0]) if row else None
                    if (stored.version if stored else None) != (
                            roll.before.version if roll.before else None):
                        continue  # another roll got here first: the next one sees it
                    for (model, period, start), delta in row_deltas(roll.before,
                                                                    roll.after).items():
                        if start >= kept_since(period, now):
                            add(sums.setdefault((roll.namespace, model, period, start), {}),
                                delta)
                    c.execute("INSERT OR REPLACE INTO ett_contrib (namespace, job, model, "
                              "lost_s, last_seen, contribution) VALUES (?, ?, ?, ?, ?, ?)",
                              (roll.namespace, roll.job, roll.after.model, roll.after.lost_s,
                               roll.after.last_seen, roll.after.to_json()))
                    done += 1
                for (ns, model, period, start), delta in sums.items():
                    row = c.execute("SELECT counters FROM ett_rollups WHERE namespace=? AND "
                                    "period=? AND start=? AND model=?",
                                    (ns, period, start, model)).fetchone()
                    counters = vector(delta, decode([row[0]])[0] if row else None)
                    c.execute("INSERT OR REPLACE INTO ett_rollups (namespace, period, start, "
                              "model, counters) VALUES (?, ?, ?, ?, ?)",
                              (ns, period, start, model, encode(counters)))
            return done

        return await self._run(op) if rolls else 0

    async def ett_models(self, namespace: str) -> set[str]:
        since = int(time.time() - MODELS_DAYS * rollups.DAY)
        rows = await self._rows("SELECT DISTINCT model FROM ett_rollups WHERE namespace=? "
                                "AND period='d' AND start >= ? LIMIT ?",
                                (namespace, since, rollups.MAX_MODELS + 1))
        return {m for (m,) in rows}

    async def ett_rows(self, *, namespace: str | None, period: str, since: int, until: int,
                       model: str | None = None) -> list[tuple[str, str, int, Vector]]:
        where, args = ["period=?", "start BETWEEN ? AND ?"], [period, since, until]
        if namespace is not None:
            where.insert(0, "namespace=?")
            args.insert(0, namespace)
        if model is not None:
            where.append("model=?")
            args.append(model)
        rows = await self._rows("SELECT namespace, model, start, counters FROM ett_rollups "
                                f"WHERE {' AND '.join(where)}", args)
        counters = decode([raw for *_, raw in rows])  # one JSON decode for them all
        return [(ns, m, int(start), vec)
                for (ns, m, start, _), vec in zip(rows, counters, strict=True)]

    async def ett_top_lost(self, *, namespace: str | None, since: float, limit: int
                           ) -> list[tuple[str, str, str, float, float]]:
        where, args = "last_seen >= ? AND lost_s > 0", [since]
        if namespace is not None:
            where = "namespace=? AND " + where
            args.insert(0, namespace)  # type: ignore[arg-type]
        rows = await self._rows("SELECT namespace, job, model, lost_s, last_seen FROM "
                                f"ett_contrib WHERE {where} ORDER BY lost_s DESC, job "
                                "LIMIT ?", (*args, limit))
        return [(ns, job, model, float(lost), float(seen)) for ns, job, model, lost, seen
                in rows]

    async def ett_roll_mark(self) -> float:
        row = await self._read("SELECT at FROM ett_marks WHERE key=?", (MARK,))
        return float(row[0]) if row else 0.0

    async def set_ett_roll_mark(self, at: float) -> None:
        await self._write(lambda c: c.execute(
            "INSERT OR REPLACE INTO ett_marks (key, at) VALUES (?, ?)", (MARK, at)))

    async def prune_ett(self, now: float, jobs_before: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            with transaction(c, immediate=True):
                gone = c.execute("DELETE FROM ett_contrib WHERE last_seen < ?",
                                 (jobs_before,)).rowcount
                for period in ("h", "d"):
                    gone += c.execute("DELETE FROM ett_rollups WHERE period=? AND start < ?",
                                      (period, kept_since(period, now))).rowcount
            return int(gone)

        return await self._run(op)
