"""ProgressStore on SQLite: a row per job attempt holding its summary (JSON), folded in
inside `BEGIN IMMEDIATE` so batches from every worker on the file fold into one summary,
and a row per job with when it last reported (listings, the namespace's cap, pruning).
Committed without an fsync (`unsynced`), as rate buckets are: a heartbeat is worth losing
on a power cut, not an fsync per request."""

from __future__ import annotations

import sqlite3
from typing import TypeVar

from anyio import to_thread

from megacache_server.store.index.progress import (
    MAX_ATTEMPTS,
    MAX_JOBS,
    AttemptProgress,
    Fold,
    JobProgress,
    JobStamps,
    merge,
)
from megacache_server.store.index.protocols.progress import ProgressStore
from megacache_server.store.index.sqlite.connection import (
    SqliteConnection,
    filters,
    transaction,
    unsynced,
)

T = TypeVar("T")


class SqliteProgress(SqliteConnection, ProgressStore):
    async def add_progress_many(self, folds: list[Fold], *,
                                namespace_attempts: int | None = None) -> None:
        def op(c: sqlite3.Connection) -> None:
            with unsynced(c), transaction(c, immediate=True):
                for fold in folds:
                    _fold(c, fold, namespace_attempts)

        if folds:
            await self._run(op)

    async def job_progress(self, namespace: str, job: str) -> JobProgress | None:
        def op(c: sqlite3.Connection) -> JobProgress | None:
            seen = c.execute("SELECT last_seen FROM progress_jobs WHERE namespace=? AND job=?",
                             (namespace, job)).fetchone()
            return _job(c, namespace, job, seen[0]) if seen else None

        return await self._run(op)

    async def recent_progress_stamps(self, *, namespace: str | None, since: float,
                                     limit: int, per_namespace: bool = False
                                     ) -> list[tuple[str, str, float]]:
        where, args = filters(namespace=namespace)
        where = (where + " AND" if where else " WHERE") + " last_seen >= ?"
        if per_namespace and namespace is None:
            rows = await self._rows(
                "SELECT namespace, job, last_seen FROM (SELECT namespace, job, last_seen, "
                "ROW_NUMBER() OVER (PARTITION BY namespace ORDER BY last_seen DESC, job) AS n "
                f"FROM progress_jobs{where}) WHERE n <= ? "
                "ORDER BY last_seen DESC, namespace, job", (*args, since, limit))
            return [(ns, job, seen) for ns, job, seen in rows]
        rows = await self._rows(f"SELECT namespace, job, last_seen FROM progress_jobs{where} "
                                "ORDER BY last_seen DESC, namespace, job LIMIT ?",
                                (*args, since, limit))
        return [(ns, job, seen) for ns, job, seen in rows]

    async def jobs_progress(self, jobs: list[tuple[str, str, float]]) -> list[JobProgress]:
        def op(c: sqlite3.Connection) -> list[tuple[str, str, str]]:
            out: list[tuple[str, str, str]] = []
            for part in _parts(jobs):
                out += c.execute(
                    "SELECT namespace, job, summary FROM progress WHERE (namespace, job) IN "
                    f"(VALUES {','.join(['(?, ?)'] * len(part))}) ORDER BY attempt",
                    [v for ns, job, _ in part for v in (ns, job)]).fetchall()
            return out

        # one hold of the connection lock; the summaries are decoded after it, off the loop
        rows = await self._run(op) if jobs else []
        return await to_thread.run_sync(_decode, jobs, rows)  # ~70 µs an attempt

    async def attempt_stamps(self, jobs: list[tuple[str, str]]
                             ) -> dict[tuple[str, str], JobStamps]:
        """One aggregate per job over its primary-key range (the last attempt's stamp is
        the bare column of MAX(attempt): SQLite takes it from that row)."""
        def op(c: sqlite3.Connection) -> list[tuple[str, str, int, int, int, int]]:
            out: list[tuple[str, str, int, int, int, int]] = []
            for part in _parts(jobs):
                out += c.execute(
                    "SELECT namespace, job, COUNT(*), MAX(attempt), "
                    "CAST(received_at * 1000000 AS INTEGER), "
                    "SUM(CAST(received_at * 1000000 AS INTEGER)) FROM progress WHERE "
                    f"(namespace, job) IN (VALUES {','.join(['(?, ?)'] * len(part))}) "
                    "GROUP BY namespace, job", [v for key in part for v in key]).fetchall()
            return out

        rows = await self._run(op) if jobs else []
        return {(ns, job): JobStamps(n, last, last_us, total - last_us)
                for ns, job, n, last, last_us, total in rows}

    async def attempts_progress(self, wanted: list[tuple[str, str, int]]
                                ) -> dict[tuple[str, str, int], AttemptProgress]:
        """Point reads by primary key (a row-value IN of thousands of triples is not
        planned as such)."""
        def op(c: sqlite3.Connection) -> list[tuple[tuple[str, str, int], str]]:
            out = []
            for key in wanted:
                row = c.execute("SELECT summary FROM progress WHERE namespace=? AND job=? "
                                "AND attempt=?", key).fetchone()
                if row is not None:
                    out.append((key, row[0]))
            return out

        rows = await self._run(op) if wanted else []
        return await to_thread.run_sync(lambda: {
            key: AttemptProgress.from_json(summary) for key, summary in rows})

    async def prune_progress(self, before: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            with transaction(c, immediate=True):
                c.execute("DELETE FROM progress WHERE (namespace, job) IN (SELECT namespace, "
                          "job FROM progress_jobs WHERE last_seen < ?)", (before,))
                return int(c.execute("DELETE FROM progress_jobs WHERE last_seen < ?",
                                     (before,)).rowcount)

        return await self._run(op)


def _fold(c: sqlite3.Connection, f: Fold, budget: int | None) -> None:
    namespace, job, attempt = f.namespace, f.job, f.attempt
    row = c.execute("SELECT summary FROM progress WHERE namespace=? AND job=? AND attempt=?",
                    (namespace, job, attempt)).fetchone()
    state = AttemptProgress.from_json(row[0]) if row else None
    if state is None and _too_old(c, namespace, job, attempt):
        return  # the job keeps its newest MAX_ATTEMPTS attempts
    summary = merge(state, attempt, f.model, f.records, f.now, f.count)
    c.execute("INSERT OR REPLACE INTO progress (namespace, job, attempt, summary, "
              "received_at) VALUES (?, ?, ?, ?, ?)",
              (namespace, job, attempt, summary.to_json(), f.now))
    c.execute("INSERT OR REPLACE INTO progress_jobs (namespace, job, last_seen) "
              "VALUES (?, ?, ?)", (namespace, job, f.now))
    if state is None:
        c.execute("DELETE FROM progress WHERE namespace=? AND job=? AND attempt "
                  "NOT IN (SELECT attempt FROM progress WHERE namespace=? AND "
                  "job=? ORDER BY attempt DESC LIMIT ?)",
                  (namespace, job, namespace, job, MAX_ATTEMPTS))
        _cap_jobs(c, namespace)
        if budget is not None:
            _cap_attempts(c, namespace, budget)


def _parts(keys: list[T], size: int = 400) -> list[list[T]]:
    """`keys` in parts small enough for one statement's variables (SQLite's limit)."""
    return [keys[i:i + size] for i in range(0, len(keys), size)]


def _too_old(c: sqlite3.Connection, namespace: str, job: str, attempt: int) -> bool:
    """Whether the job already keeps MAX_ATTEMPTS attempts, all newer than `attempt`."""
    row = c.execute("SELECT COUNT(*), MIN(attempt) FROM progress WHERE namespace=? AND job=?",
                    (namespace, job)).fetchone()
    return bool(row[0] >= MAX_ATTEMPTS and attempt < row[1])


def _cap_jobs(c: sqlite3.Connection, namespace: str) -> None:
    """Past MAX_JOBS jobs, the namespace's longest silent ones go."""
    n = c.execute("SELECT COUNT(*) FROM progress_jobs WHERE namespace=?",
                  (namespace,)).fetchone()[0]
    if n <= MAX_JOBS:
        return
    gone = c.execute("SELECT job FROM progress_jobs WHERE namespace=? ORDER BY last_seen "
                     "LIMIT ?", (namespace, n - MAX_JOBS)).fetchall()
    for (job,) in gone:
        c.execute("DELETE FROM progress WHERE namespace=? AND job=?", (namespace, job))
        c.execute("DELETE FROM progress_jobs WHERE namespace=? AND job=?", (namespace, job))


def _cap_attempts(c: sqlite3.Connection, namespace: str, budget: int) -> None:
    """Past `budget` attempts kept, the namespace's longest-silent jobs go whole (each
    holds at least one attempt, so the `excess` longest silent are all it may take)."""
    excess = c.execute("SELECT COUNT(*) FROM progress WHERE namespace=?",
                       (namespace,)).fetchone()[0] - budget
    if excess <= 0:
        return
    oldest = c.execute("SELECT j.job, (SELECT COUNT(*) FROM progress p WHERE p.namespace="
                       "j.namespace AND p.job=j.job) FROM progress_jobs j WHERE j.namespace=? "
                       "ORDER BY j.last_seen, j.job LIMIT ?", (namespace, excess)).fetchall()
    for job, held in oldest:
        c.execute("DELETE FROM progress WHERE namespace=? AND job=?", (namespace, job))
        c.execute("DELETE FROM progress_jobs WHERE namespace=? AND job=?", (namespace, job))
        excess -= held
        if excess <= 0:
            return


def _job(c: sqlite3.Connection, namespace: str, job: str, seen: float) -> JobProgress:
    rows = c.execute("SELECT summary FROM progress WHERE namespace=? AND job=? "
                     "ORDER BY attempt", (namespace, job)).fetchall()
    return JobProgress(namespace, job, seen,
                       tuple(AttemptProgress.from_json(r[0]) for r in rows))


def _decode(jobs: list[tuple[str, str, float]],
            rows: list[tuple[str, str, str]]) -> list[JobProgress]:
    found: dict[tuple[str, str], list[AttemptProgress]] = {}
    for ns, job, summary in rows:
        found.setdefault((ns, job), []).append(AttemptProgress.from_json(summary))
    return [JobProgress(ns, job, seen, tuple(found[(ns, job)]))
            for ns, job, seen in jobs if (ns, job) in found]
