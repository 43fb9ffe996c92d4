"""A month of the fleet's ETT read in one query: the trend of 20,000 jobs over 30 days.

Issue 60, item 4 (goal: <= 100 ms). The jobs' progress is made up (each: 1-3 attempts,
one to twenty hours, hourly checkpoints, failures of random causes, one of `--models`
models, starts spread over the last 30 days), split as the server splits it (`ett.split`),
and rolled into the rollups as the server's roller does (`ett_trend.contribution`,
`roll_ett`), in a real index (SQLite, and Redis with `--redis URL`). Then the trend is read
as `GET /v1/ett/trend?days=30` reads it (`ett_rows` + `ett_trend.trend`), `--reads` times
(wall and CPU time: on a shared machine the wall time waits for the CPU),
and over HTTP from a real server on the same store (SQLite; reads a second apart, as a
namespace's views may take a quarter of the server's time: `split_cache.Lane`). The table:
rows read, and p50/p90 of the read, by backend and period.

    python -m benchmarks ett_trend_bench                      # 20,000 jobs, SQLite
    python -m benchmarks ett_trend_bench --jobs 2000 --reads 5   # a quick check

Results: a table on stdout, JSON (`--out`, default benchmarks/results/ett_trend.json).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.benchlib import (
    BENCH_DIR,
    log,
    temp_root,
    text_table,
)
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer
from megacache_client.wire.progress import CAUSES, ProgressRecord
from megacache_server.service.ett import split as ett
from megacache_server.service.ett import trend as ett_trend
from megacache_server.store.index.base import Index
from megacache_server.store.index.ett_rollups import Roll
from megacache_server.store.index.progress import JobProgress, merge
from megacache_server.store.index.sqlite import SqliteIndex

NAMESPACE = "default"
DAYS = 30


def job(rng: random.Random, i: int, now: float, models: int) -> JobProgress:
    """One made-up job: its attempts' summaries, as the index would keep them."""
    start = now - rng.uniform(0.5, DAYS - 1) * 86400
    attempts = []
    at = start
    n = rng.choice((1, 1, 1, 2, 3))
    for a in range(n):
        train = at + rng.uniform(30, 900)
        hours = rng.uniform(1, 20) / n
        last = min(train + hours * 3600, now - 60)
        records = [ProgressRecord(kind="start", at=at), ProgressRecord(kind="training", at=train),
                   ProgressRecord(kind="heartbeat", at=last, step=int(hours * 3600))]
        records += [ProgressRecord(kind="checkpoint_save", at=t, step=k, blocking_s=5.0)
                    for k, t in enumerate(range(int(train) + 3600, int(last), 3600))]
        if a < n - 1 or rng.random() < 0.1:
            records.append(ProgressRecord(kind="end", at=last, reason="failed",
                                          cause=rng.choice(CAUSES[:5])))
        else:
            records.append(ProgressRecord(kind="end", at=last, reason="finished"))
        attempts.append(merge(None, a, f"model-{i % models}", records, now))
        at = last + rng.uniform(30, 600)
    return JobProgress(NAMESPACE, f"job-{i}", now, tuple(attempts))


async def fill(index: Index, jobs: int, models: int, seed: int) -> int:
    """Roll `jobs` made-up jobs into the index's rollups; how many rows they touched."""
    rng, now = random.Random(seed), time.time()
    rolls = []
    for i in range(jobs):
        split = ett.split(job(rng, i, now, models), now=now)
        rolls.append(Roll(NAMESPACE, split.job, None,
                          ett_trend.contribution(split, split.model or "")))
        if len(rolls) == 500:
            await index.roll_ett(rolls)
            rolls = []
    await index.roll_ett(rolls)
    return len(await index.ett_rows(namespace=NAMESPACE, period="d", since=int(now - 31 * 86400),
                                    until=int(now)))


async def read(index: Index, period: str, days: float) -> tuple[float, float, int]:
    """One trend read as the server makes it: (seconds, CPU seconds, rows)."""
    now = time.time()
    began, cpu = time.perf_counter(), time.process_time()
    rows = await index.ett_rows(namespace=NAMESPACE, period=period,
                                since=int(now - days * 86400), until=int(now))
    top = await index.ett_top_lost(namespace=NAMESPACE, since=now - days * 86400, limit=10)
    ett_trend.trend(rows, period, int(now - days * 86400), int(now), top)
    return time.perf_counter() - began, time.process_time() - cpu, len(rows)


def quantiles(samples: list[float], prefix: str = "") -> dict[str, float]:
    ordered = sorted(samples)
    return {f"{prefix}p50_ms": round(1000 * statistics.median(ordered), 1),
            f"{prefix}p90_ms": round(1000 * ordered[max(0, int(0.9 * len(ordered)) - 1)], 1)}


async def bench_index(index: Index, args: argparse.Namespace, name: str) -> list[dict[str, Any]]:
    await index.open()
    try:
        began = time.perf_counter()
        rows = await fill(index, args.jobs, args.models, args.seed)
        log(f"{name}: {args.jobs} jobs rolled ({rows} daily rows) in "
            f"{time.perf_counter() - began:.1f} s")
        out = []
        for period, days in (("d", DAYS), ("h", 7)):
            samples, cpus, n = [], [], 0
            for _ in range(args.reads):
                took, cpu, n = await read(index, period, days)
                samples.append(took)
                cpus.append(cpu)
            out.append({"backend": name, "read": f"{days} days per {period}", "rows": n,
                        **quantiles(samples), **quantiles(cpus, "cpu_")})
        return out
    finally:
        await index.close()


def bench_http(data: Path, reads: int) -> dict[str, Any]:
    server = LocalServer(data, env={"MEGACACHE_ETT_ROLL_S": "0"}).start()
    try:
        samples = []
        with httpx.Client(base_url=server.url, timeout=60) as c:
            c.get("/v1/ett/trend", params={"days": DAYS}).raise_for_status()  # warm
            for _ in range(reads):
                time.sleep(1.0)  # past the namespace's view lane (a quarter of the time)
                began = time.perf_counter()
                r = c.get("/v1/ett/trend", params={"days": DAYS})
                samples.append(time.perf_counter() - began)
                r.raise_for_status()
            jobs = sum(p["time_to_start"]["n"] for p in r.json()["series"])
    finally:
        server.stop()
    return {"backend": "sqlite, over HTTP", "read": f"{DAYS} days per d",
            "rows": f"{jobs} starts", **quantiles(samples)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--models", type=int, default=50)
    p.add_argument("--reads", type=int, default=20)
    p.add_argument("--seed", type=int, default=60)
    p.add_argument("--redis", help="also a Redis index at this URL (a prefix of its own)")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "ett_trend.json")
    args = p.parse_args(argv)
    with temp_root("megacache-trend-", False) as root:
        data = root / "data"
        data.mkdir()
        found = asyncio.run(bench_index(SqliteIndex(data / "index.sqlite3"), args, "sqlite"))
        if args.redis:
            from megacache_server.store.index.redis import RedisIndex

            redis = RedisIndex(args.redis, prefix=f"trend{time.time_ns()}:")
            found += asyncio.run(bench_index(redis, args, "redis"))
        found.append(bench_http(data, args.reads))
    print(text_table(("backend", "read", "rows", "p50 ms", "p90 ms", "CPU p50 ms"),
                     [(f["backend"], f["read"], str(f["rows"]), f"{f['p50_ms']:.1f}",
                       f"{f['p90_ms']:.1f}", str(f.get("cpu_p50_ms", "-"))) for f in found]))
    write_record(make_record("ett_trend_bench", given_argv(argv), found, jobs=args.jobs,
                             models=args.models), args.out)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
