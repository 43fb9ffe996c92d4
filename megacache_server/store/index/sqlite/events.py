"""EventLog on SQLite: a row per raw event, and rollup tables (`rollup_total`, hourly and
daily, miss reasons, `job_attempts`) updated in the transaction that adds the event
(`rollups.py` says how an event folds into them)."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from megacache_client.wire.events import Event
from megacache_server.store.index import rollups
from megacache_server.store.index.protocols import events
from megacache_server.store.index.sqlite.connection import SqliteConnection, filters, transaction


class SqliteEvents(SqliteConnection, events.EventLog):
    async def add_event(self, namespace: str, event: Event) -> None:
        now = time.time()
        counters = rollups.event_counters(event)
        hour = rollups.event_hour(event, now)

        def op(c: sqlite3.Connection) -> None:
            with transaction(c, immediate=True):
                c.execute("INSERT INTO events (received_at, namespace, event) VALUES (?, ?, ?)",
                          (now, namespace, event.to_json()))
                model = _admitted_model(c, namespace, event.model)
                day = hour // rollups.DAY * rollups.DAY
                own = counters
                if event.job_id is None:  # a run of its own: its own attempt 0
                    _, deltas = rollups.attempt_update(None, event, model, hour, now)
                    own = rollups.merged(counters, deltas)
                else:
                    state, deltas = _attempt(c, namespace, event, model, hour, now)
                    if (state.model, state.hour) == (model, hour):
                        own = rollups.merged(counters, deltas)
                    elif deltas:  # a later rank: its attempt's counts stay where they began
                        _add_rollups(c, namespace, state.model, state.hour, deltas)
                _add_rollups(c, namespace, model, hour, own)
                if rollups.counts_miss(event):
                    for table, column, period in (("miss_reasons", "hour", hour),
                                                  ("miss_reasons_daily", "day", day)):
                        row = (namespace, period, model, event.outcome, event.reason[:200])
                        c.execute(f"""INSERT INTO {table} VALUES (?, ?, ?, ?, ?, 1)
                                      ON CONFLICT DO UPDATE SET count=count+1""",
                                  _admitted_reason(c, table, column, row))

        await self._run(op)

    async def stats(self, *, namespace: str | None, since: float | None = None
                    ) -> list[events.ModelStats]:
        sums = ", ".join(f"TOTAL({c})" for c in rollups.COUNTERS)
        where, args = filters(namespace=namespace)
        if since is None:
            sql = f"SELECT namespace, model, {sums} FROM rollup_total{where} " \
                  "GROUP BY namespace, model"
        else:
            rows, args = _windowed("namespace, model, " + ", ".join(rollups.COUNTERS),
                                   "rollup", namespace, rollups.window(since, time.time()))
            sql = f"SELECT namespace, model, {sums} FROM ({rows}) GROUP BY namespace, model"
        found = await self._rows(sql, args)
        return _model_stats(found)

    async def timeline(self, *, namespace: str | None, since: float,
                       daily: bool = False) -> list[events.TimelineSlot]:
        rows, args = _windowed("runs, hit + fallback AS warm, saved_s, tts_s, tts_n", "rollup",
                               namespace, rollups.window(since, time.time(), days=daily))
        found = await self._rows(
            "SELECT period, TOTAL(runs), TOTAL(warm), TOTAL(saved_s), TOTAL(tts_s), "
            f"TOTAL(tts_n) FROM ({rows}) GROUP BY period ORDER BY period", args)
        return [events.TimelineSlot(int(h), int(r), int(w), s, t, int(n))
                for h, r, w, s, t, n in found]

    async def top_misses(self, *, namespace: str | None, since: float,
                         limit: int) -> list[events.MissReason]:
        rows, args = _windowed("model, outcome, reason, count", "miss_reasons", namespace,
                               rollups.window(since, time.time()))
        found = await self._rows(
            f"SELECT model, outcome, reason, SUM(count) AS n FROM ({rows}) "
            "GROUP BY model, outcome, reason ORDER BY n DESC, model LIMIT ?", (*args, limit))
        return [events.MissReason(m, o, r, int(n)) for m, o, r, n in found]

    async def recent_jobs(self, *, namespace: str | None, limit: int) -> list[events.JobView]:
        def op(c: sqlite3.Connection) -> list[events.JobView]:
            # newest reports first along the last_seen index, until `limit` distinct jobs:
            # a dashboard reads a few dozen rows, not every job of the namespace
            where, args = filters(namespace=namespace)
            seen: dict[tuple[str, str], float] = {}
            for ns, job, last in c.execute(
                    f"SELECT namespace, job, last_seen FROM job_attempts{where} "
                    "ORDER BY last_seen DESC", args):
                seen.setdefault((ns, job), last)
                if len(seen) >= limit:
                    break
            return [_view(c, ns, job, last) for (ns, job), last in seen.items()]

        return await self._run(op)

    async def job_view(self, namespace: str, job: str) -> events.JobView | None:
        def op(c: sqlite3.Connection) -> events.JobView | None:
            last = c.execute("SELECT MAX(last_seen) FROM job_attempts WHERE namespace=? AND "
                             "job=?", (namespace, job)).fetchone()[0]
            return _view(c, namespace, job, last) if last is not None else None

        return await self._run(op)

    async def prune_events(self, *, raw_before: float, rollups_before: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            with transaction(c, immediate=True):
                n = c.execute("DELETE FROM events WHERE received_at < ?",
                              (raw_before,)).rowcount
                c.execute("DELETE FROM job_attempts WHERE last_seen < ?", (raw_before,))
                _cap_jobs(c)
                for table, period in (("rollup_hourly", "hour"), ("miss_reasons", "hour"),
                                      ("rollup_daily", "day"), ("miss_reasons_daily", "day")):
                    c.execute(f"DELETE FROM {table} WHERE {period} < ?",
                              (rollups.hour_of(rollups_before) // rollups.DAY * rollups.DAY
                               if period == "day" else rollups_before,))
                return int(n)

        return await self._run(op)




def _add_rollups(c: sqlite3.Connection, namespace: str, model: str, hour: int,
                 counters: dict[str, float]) -> None:
    """Add `counters` to the model's hourly, daily and total rows."""
    names = [n for n in rollups.COUNTERS if counters.get(n)]
    if not names:
        return
    values = tuple(counters[n] for n in names)
    columns, marks = ", ".join(names), ", ".join("?" * len(names))
    upsert = ", ".join(f"{n}={n}+excluded.{n}" for n in names)
    day = hour // rollups.DAY * rollups.DAY
    for table, column, period in (("rollup_hourly", "hour", hour), ("rollup_daily", "day", day)):
        c.execute(f"""INSERT INTO {table} (namespace, {column}, model, {columns})
                      VALUES (?, ?, ?, {marks}) ON CONFLICT DO UPDATE SET {upsert}""",
                  (namespace, period, model, *values))
    c.execute(f"""INSERT INTO rollup_total (namespace, model, {columns})
                  VALUES (?, ?, {marks}) ON CONFLICT DO UPDATE SET {upsert}""",
              (namespace, model, *values))


def _attempt(c: sqlite3.Connection, namespace: str, event: Event, model: str, hour: int,
             now: float) -> tuple[rollups.AttemptState, dict[str, float]]:
    """Fold one rank's report into its job attempt's record; the rollup changes it makes."""
    key = (namespace, event.job_id, event.attempt or 0)
    row = c.execute("SELECT model, hour, outcome, tts_s, compile_s, reports, world_size, "
                    "first_seen, last_seen FROM job_attempts WHERE namespace=? AND job=? "
                    "AND attempt=?", key).fetchone()
    prev = rollups.AttemptState(*row) if row else None
    state, deltas = rollups.attempt_update(prev, event, model, hour, now)
    c.execute("INSERT OR REPLACE INTO job_attempts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
              (*key, state.model, state.hour, state.outcome, state.tts_s, state.compile_s,
               state.reports, state.world_size, state.first_seen, state.last_seen))
    return state, deltas


def _cap_jobs(c: sqlite3.Connection) -> None:
    """Keep each namespace's records of its MAX_JOBS most recently reporting jobs."""
    for (namespace,) in c.execute("SELECT DISTINCT namespace FROM job_attempts").fetchall():
        cut = c.execute("SELECT seen FROM (SELECT MAX(last_seen) AS seen FROM job_attempts "
                        "WHERE namespace=? GROUP BY job) ORDER BY seen DESC LIMIT 1 OFFSET ?",
                        (namespace, rollups.MAX_JOBS)).fetchone()
        if cut is not None:
            c.execute("DELETE FROM job_attempts WHERE namespace=? AND job IN (SELECT job FROM "
                      "job_attempts WHERE namespace=? GROUP BY job HAVING MAX(last_seen) <= ?)",
                      (namespace, namespace, cut[0]))


def _admitted_model(c: sqlite3.Connection, namespace: str, model: str) -> str:
    """`model`, or OTHER_MODELS once the namespace's rollups hold MAX_MODELS names."""
    if c.execute("SELECT 1 FROM rollup_total WHERE namespace=? AND model=?",
                 (namespace, model)).fetchone():
        return model
    known = c.execute("SELECT COUNT(*) FROM rollup_total WHERE namespace=?",
                      (namespace,)).fetchone()[0]
    return model if known < rollups.MAX_MODELS else rollups.OTHER_MODELS


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
    return row if known < rollups.MAX_REASONS else (namespace, period, model, outcome,
                                                    rollups.OTHER_REASONS)


def _windowed(columns: str, table: str, namespace: str | None,
              window: rollups.Window) -> tuple[str, tuple[Any, ...]]:
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


def _model_stats(rows: list[tuple[Any, ...]]) -> list[events.ModelStats]:
    out = []
    for namespace, model, *sums in rows:
        s = events.ModelStats(namespace, model)
        s.add(dict(zip(rollups.COUNTERS, sums, strict=True)))
        out.append(s)
    return sorted(out, key=lambda s: (-s.runs, s.namespace, s.model))


def _view(c: sqlite3.Connection, namespace: str, job: str, last: float) -> events.JobView:
    rows = c.execute(
        "SELECT model, hour, outcome, tts_s, compile_s, reports, world_size, "
        "first_seen, last_seen, attempt FROM job_attempts WHERE namespace=? AND job=? "
        "ORDER BY attempt DESC LIMIT ?", (namespace, job, events.MAX_VIEW_ATTEMPTS)).fetchall()
    return events.JobView(namespace, job, last, [events.AttemptRecord(*row) for row in rows])
