"""The SQLite index's schema: its tables, indexes and triggers, and how an older file is
brought up to date when it is opened.

Tables added after the first release (`usage`, daily rollups, blob reference counts) are
created, and filled from the rows already there, the first time a server opens a file that
lacks them; a file of another `SCHEMA_VERSION` is refused rather than guessed at.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from megacache_server.store.index import rollups

SCHEMA_VERSION = 2
_SUMS = ", ".join(f"{c} REAL NOT NULL DEFAULT 0" for c in rollups.COUNTERS)

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
CREATE TABLE IF NOT EXISTS job_attempts (
    namespace  TEXT NOT NULL,
    job        TEXT NOT NULL,
    attempt    INTEGER NOT NULL,
    model      TEXT NOT NULL,
    hour       INTEGER NOT NULL,
    outcome    TEXT NOT NULL,
    tts_s      REAL,
    compile_s  REAL NOT NULL,
    reports    INTEGER NOT NULL,
    world_size INTEGER,
    first_seen REAL NOT NULL,
    last_seen  REAL NOT NULL,
    PRIMARY KEY (namespace, job, attempt)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS job_attempts_by_seen ON job_attempts (namespace, last_seen);
CREATE INDEX IF NOT EXISTS job_attempts_by_age ON job_attempts (last_seen);
CREATE TABLE IF NOT EXISTS heartbeat (id INTEGER PRIMARY KEY, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS resolutions (
    namespace       TEXT NOT NULL,
    job             TEXT NOT NULL,
    attempt         INTEGER NOT NULL,
    key             TEXT NOT NULL,
    manifest        BLOB NOT NULL,
    etag            TEXT NOT NULL,
    entry_namespace TEXT NOT NULL,
    digests         TEXT NOT NULL,
    resolved_at     REAL NOT NULL,
    expires_at      REAL NOT NULL,
    PRIMARY KEY (namespace, job, attempt, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS resolutions_by_expiry ON resolutions (expires_at);
CREATE TABLE IF NOT EXISTS held_blobs (
    digest   TEXT PRIMARY KEY,
    until    REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS held_blobs_by_until ON held_blobs (until);
CREATE TABLE IF NOT EXISTS pending_holds (
    namespace   TEXT NOT NULL,
    hold_id     TEXT NOT NULL,
    size        INTEGER NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (namespace, hold_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rate_buckets (
    bucket  TEXT PRIMARY KEY,
    tokens  REAL NOT NULL,
    at      REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sequences (
    key       TEXT PRIMARY KEY,
    sequence  INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS progress (
    namespace   TEXT NOT NULL,
    job         TEXT NOT NULL,
    attempt     INTEGER NOT NULL,
    summary     TEXT NOT NULL,
    received_at REAL NOT NULL,
    PRIMARY KEY (namespace, job, attempt)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS progress_jobs (
    namespace   TEXT NOT NULL,
    job         TEXT NOT NULL,
    last_seen   REAL NOT NULL,
    PRIMARY KEY (namespace, job)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS progress_jobs_by_seen ON progress_jobs (namespace, last_seen);
CREATE INDEX IF NOT EXISTS progress_jobs_by_age ON progress_jobs (last_seen);
CREATE TABLE IF NOT EXISTS ett_rollups (
    namespace   TEXT NOT NULL,
    period      TEXT NOT NULL,
    start       INTEGER NOT NULL,
    model       TEXT NOT NULL,
    counters    TEXT NOT NULL,
    PRIMARY KEY (namespace, period, start, model)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ett_rollups_by_start ON ett_rollups (period, start);
CREATE TABLE IF NOT EXISTS ett_contrib (
    namespace    TEXT NOT NULL,
    job          TEXT NOT NULL,
    model        TEXT NOT NULL,
    lost_s       REAL NOT NULL,
    last_seen    REAL NOT NULL,
    contribution TEXT NOT NULL,
    PRIMARY KEY (namespace, job)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ett_contrib_by_lost ON ett_contrib (namespace, lost_s);
CREATE INDEX IF NOT EXISTS ett_contrib_by_seen ON ett_contrib (last_seen);
CREATE TABLE IF NOT EXISTS ett_marks (
    key  TEXT PRIMARY KEY,
    at   REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS claims (
    namespace   TEXT NOT NULL,
    key         TEXT NOT NULL,
    holder      TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID;
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
INSERT INTO rollup_daily SELECT namespace, hour / {rollups.DAY} * {rollups.DAY}, model,
    {", ".join(f"TOTAL({c})" for c in rollups.COUNTERS)} FROM rollup_hourly GROUP BY 1, 2, 3;
INSERT INTO miss_reasons_daily SELECT namespace, hour / {rollups.DAY} * {rollups.DAY}, model,
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
others. Added to older stores on first open."""


TRUST_SCHEMA = """
ALTER TABLE entries ADD COLUMN provenance TEXT NOT NULL DEFAULT '';
ALTER TABLE blobs ADD COLUMN verified_at REAL NOT NULL DEFAULT 0;
CREATE INDEX blobs_by_verified ON blobs (verified_at, digest);
CREATE TABLE quarantine (
    id          INTEGER PRIMARY KEY,
    digest      TEXT NOT NULL,
    reason      TEXT NOT NULL,
    detail      TEXT NOT NULL,
    reporter    TEXT NOT NULL,
    at          REAL NOT NULL,
    size        INTEGER NOT NULL,
    namespaces  TEXT NOT NULL,
    withdrawn   TEXT NOT NULL
);
CREATE INDEX quarantine_by_digest ON quarantine (digest);
CREATE TABLE quarantine_counts (reason TEXT PRIMARY KEY, count INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE quarantined_blobs (digest TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE load_reports (
    key       TEXT NOT NULL,
    etag      TEXT NOT NULL,
    reporter  TEXT NOT NULL,
    at        REAL NOT NULL,
    PRIMARY KEY (key, etag, reporter)
) WITHOUT ROWID;
CREATE INDEX load_reports_by_time ON load_reports (at);
"""
"""Who wrote each entry (`entries.provenance`), when each blob was last re-hashed (the
scrub reads them longest-unverified first; 0 for blobs recorded before), quarantined blobs
and reports of entries torch could not load. Added to older stores on first open."""


def create(conn: sqlite3.Connection, path: Path) -> None:
    """Create what is missing (inside the caller's transaction); refuse another version."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    has_entries = conn.execute("SELECT 1 FROM sqlite_master WHERE name='entries'").fetchone()
    if has_entries and version != SCHEMA_VERSION:
        raise RuntimeError(
            f"{path} holds an index of schema {version}, this server reads "
            f"{SCHEMA_VERSION}: start from an empty data dir (blobs can be re-uploaded)")
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    _add_counters(conn)
    for table, script in (("usage", USAGE_SCHEMA), ("rollup_daily", DAILY_SCHEMA),
                          ("blobs_unreferenced", REFS_SCHEMA),
                          ("blobs_by_verified", TRUST_SCHEMA)):
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name=?", (table,)).fetchone():
            for statement in _statements(script):
                conn.execute(statement)
    _add_counters(conn)
    _add_columns(conn, "quarantine", {"reporter_namespace": "TEXT NOT NULL DEFAULT ''"})
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def _add_counters(conn: sqlite3.Connection) -> None:
    """Counters added to the rollups after a file was made (the job counters), as columns
    of zeros."""
    for table in ("rollup_hourly", "rollup_daily", "rollup_total"):
        _add_columns(conn, table, dict.fromkeys(rollups.COUNTERS, "REAL NOT NULL DEFAULT 0"))


def _add_columns(conn: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Columns added to a table (where it exists) after a file was made, with their
    declarations."""
    have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    for column, declaration in columns.items():
        if have and column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")


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
