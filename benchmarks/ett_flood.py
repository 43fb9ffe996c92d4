"""A hostile tenant's ETT history and read flood, and what another tenant's lookups pay for it.

Issue 47, item 2 ("reads cost the page, not the history"). Against one real server (sqlite
index, fs blobs, one worker, auth off: the two tenants are two clients):

1. fill: `--jobs` jobs x `--attempts` attempts of progress (a start, training, a heartbeat
   and, but for the last attempt, a failure), posted through the real route
   `POST /v1/jobs/{job}/progress` from `--senders` threads (progress rate limit off, as six
   write tokens each within theirs would post it), or with `--fill store` the same history
   written into the index before the server starts; the server keeps all of it (its
   progress budget raised to it, as before the budget existed);
2. quiet: the other tenant's exact lookups (`lookup_load.py`, a process of its own) for
   `--quiet-s` seconds, nothing else running; then the first (cold) dashboard, stats and jobs;
3. flood: for `--seconds`, the hostile tenant reloads dashboard, stats, jobs and one job's
   ETT in a loop (`--readers` threads) and heartbeats its jobs (`--beaters` threads,
   `--beat-rate` a second in all) while the other tenant's lookups run;
4. the server's RSS (VmRSS of its process group) before the fill, after it, and its peak
   during reads and flood.

Goal (issue 47): flooded lookup p99 <= 1.5x quiet, RSS growth from the reads <= +200 MiB.

    python -m benchmarks ett_flood                          # 1000 jobs x 64 attempts
    python -m benchmarks ett_flood --fill store             # the same, filled in seconds
    python -m benchmarks ett_flood --jobs 100 --attempts 8 --seconds 10   # a quick check
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from benchmarks.ett_bench import MISS, post, server_on, summary
from benchmarks.harness.benchlib import (
    BENCH_DIR,
    log,
    proc_field,
    temp_root,
    text_table,
)
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer
from benchmarks.scale_bench import Lookups

VIEWS = ("/v1/dashboard", "/v1/stats", "/v1/jobs")


def group_rss_mib(pgid: int) -> float:
    """Resident memory of every process of the server's group (its workers too), MiB."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
        except OSError:
            continue
        value = proc_field(f"/proc/{entry}/status", "VmRSS")
        total += int(value.split()[0]) if value else 0
    return round(total / 1024, 1)


class RssPeak:
    """The highest group RSS seen, sampled every 0.2 s in a thread while active."""

    def __init__(self, pgid: int) -> None:
        self.pgid, self.peak = pgid, group_rss_mib(pgid)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            self.peak = max(self.peak, group_rss_mib(self.pgid))

    def __enter__(self) -> RssPeak:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


def attempt_records(j: int, a: int, attempts: int, base: float) -> list[dict[str, Any]]:
    """Attempt `a` of job `j`: a start, training, a heartbeat and (but the last) a failure."""
    at = base + a * 120 + (j % 60)
    records: list[dict[str, Any]] = [
        {"kind": "start", "at": at}, {"kind": "training", "at": at + 20},
        {"kind": "heartbeat", "at": at + 100, "step": 10 * a + 5}]
    if a < attempts - 1:
        records.append({"kind": "end", "at": at + 110, "reason": "failed"})
    return records


def fill_store(data_dir: Path, jobs: int, attempts: int) -> float:
    """The same history written straight into the server's SQLite index before it starts
    (`--fill store`: seconds instead of minutes; the reads measured are the same)."""
    import asyncio

    from megacache_client.wire.progress import ProgressRecord
    from megacache_server.store.index.progress import Fold
    from megacache_server.store.index.sqlite import SqliteIndex

    async def write() -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        index = SqliteIndex(data_dir / "index.sqlite3")
        await index.open()
        now = time.time()
        base = now - attempts * 120 - 600
        try:
            for j in range(jobs):
                await index.add_progress_many([Fold(
                    "default", f"flood-{j}", a, f"model-{j % 20}",
                    [ProgressRecord(**r) for r in attempt_records(j, a, attempts, base)],
                    now, 4) for a in range(attempts)])
        finally:
            await index.close()

    began = time.perf_counter()
    asyncio.run(write())
    return time.perf_counter() - began


def fill(url: str, jobs: int, attempts: int, senders: int) -> float:
    """Every job's attempts, oldest first (`attempt_records`), over HTTP; seconds it took."""
    base = time.time() - attempts * 120 - 600

    def send(part: range) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            for j in part:
                for a in range(attempts):
                    post(c, f"flood-{j}", a, attempt_records(j, a, attempts, base),
                         model=f"model-{j % 20}")

    began = time.perf_counter()
    step = -(-jobs // senders)
    with ThreadPoolExecutor(senders) as pool:
        list(pool.map(send, [range(i, min(jobs, i + step)) for i in range(0, jobs, step)]))
    return time.perf_counter() - began


def timed_get(c: httpx.Client, path: str) -> float:
    t = time.perf_counter()
    r = c.get(path)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - t


def flood(url: str, args: argparse.Namespace, stop: threading.Event,
          reads: dict[str, list[float]], beats: list[float]) -> list[threading.Thread]:
    """Reader and heartbeat threads of the hostile tenant, running until `stop`."""

    def reader(k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                for path in VIEWS:
                    reads[path].append(timed_get(c, path))
                reads["ett"].append(timed_get(c, f"/v1/jobs/flood-{rng.randrange(args.jobs)}/ett"))

    def beater(k: int) -> None:
        rng = random.Random(100 + k)
        gap = args.beaters / args.beat_rate
        due = time.perf_counter()
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                due += gap
                if (wait := due - time.perf_counter()) > 0:
                    stop.wait(wait)
                j = rng.randrange(args.jobs)
                beats.append(post(c, f"flood-{j}", args.attempts - 1,
                                  [{"kind": "heartbeat", "at": time.time(), "step": 10**6}]))

    threads = [threading.Thread(target=reader, args=(k,), daemon=True)
               for k in range(args.readers)]
    threads += [threading.Thread(target=beater, args=(k,), daemon=True)
                for k in range(args.beaters)]
    for t in threads:
        t.start()
    return threads


def lookup_ms(lookups: Lookups, start: float, end: float) -> dict[str, float]:
    return summary([e - s for s, e in lookups.done if s >= start and e <= end])


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The server keeps the whole history (its progress budget raised to it): the reads
    are measured against every attempt the tenant sent."""
    stored = None
    if args.fill == "store":
        stored = fill_store(root / "data", args.jobs, args.attempts)
    env = {"MEGACACHE_PROGRESS_RATE": "0",
           "MEGACACHE_PROGRESS_NAMESPACE_ATTEMPTS": str(args.jobs * args.attempts + 1)}
    with server_on("sqlite+fs", root, extra_env=env) as server:
        return measure(server, args, stored)


def measure(server: LocalServer, args: argparse.Namespace,
            stored: float | None) -> dict[str, Any]:
    assert server.proc is not None
    pgid = server.proc.pid
    rss: dict[str, float] = {"start": group_rss_mib(pgid)}
    log(f"filling {args.jobs} jobs x {args.attempts} attempts ({args.fill})")
    fill_s = stored if stored is not None else fill(server.url, args.jobs, args.attempts,
                                                   args.senders)
    time.sleep(2)  # the heartbeat buffer's flush
    rss["filled"] = group_rss_mib(pgid)
    log(f"filled in {fill_s:.1f} s; RSS {rss['filled']} MiB")
    sample = [SimpleNamespace(key=MISS)]
    first: dict[str, float] = {}
    with Lookups(server, sample) as lookups:  # type: ignore[arg-type]
        q0 = time.perf_counter()
        time.sleep(args.quiet_s)
        q1 = time.perf_counter()
        with RssPeak(pgid) as peak_first, httpx.Client(base_url=server.url, timeout=600) as c:
            for path in VIEWS:
                first[path] = timed_get(c, path)
                log(f"first {path}: {first[path]:.2f} s")
            first["ett"] = timed_get(c, "/v1/jobs/flood-0/ett")
        rss["after_first_reads"] = group_rss_mib(pgid)
        rss["peak_first_reads"] = peak_first.peak
        log(f"flood for {args.seconds:g} s")
        stop = threading.Event()
        reads: dict[str, list[float]] = {p: [] for p in (*VIEWS, "ett")}
        beats: list[float] = []
        with RssPeak(pgid) as peak_flood:
            f0 = time.perf_counter()
            threads = flood(server.url, args, stop, reads, beats)
            time.sleep(args.seconds)
            f1 = time.perf_counter()
            stop.set()
            for t in threads:
                t.join()
        rss["peak_flood"] = peak_flood.peak
        rss["after"] = group_rss_mib(pgid)
    quiet, flooded = lookup_ms(lookups, q0, q1), lookup_ms(lookups, f0, f1)
    return {
        "jobs": args.jobs, "attempts": args.attempts, "fill": args.fill, "fill_s": round(fill_s, 1),
        "lookup_quiet": quiet, "lookup_flood": flooded,
        "lookup_p99_ratio": round(flooded["p99_ms"] / max(quiet["p99_ms"], 1e-9), 2),
        "first_s": {k: round(v, 3) for k, v in first.items()},
        "refresh": {k: summary(v) for k, v in reads.items()},
        "heartbeats": summary(beats), "rss_mib": rss,
        "rss_growth_mib": round(max(rss["peak_first_reads"], rss["peak_flood"])
                                - rss["filled"], 1),
    }


def table(r: dict[str, Any]) -> str:
    rows = [["lookup quiet p50 / p99 ms",
             f"{r['lookup_quiet']['p50_ms']:.1f} / {r['lookup_quiet']['p99_ms']:.1f}"],
            ["lookup flooded p50 / p99 ms",
             f"{r['lookup_flood']['p50_ms']:.1f} / {r['lookup_flood']['p99_ms']:.1f}"],
            ["lookup p99 ratio (goal <= 1.5)", f"{r['lookup_p99_ratio']:.2f}"]]
    for view in (*VIEWS, "ett"):
        ref = r["refresh"][view]
        rows.append([f"{view} first s / refresh p50, p99 ms (n)",
                     f"{r['first_s'][view]:.2f} / {ref['p50_ms']:.0f}, {ref['p99_ms']:.0f} "
                     f"({ref['n']})"])
    hb = r["heartbeats"]
    rows.append(["heartbeat p50 / p99 ms (n)", f"{hb['p50_ms']:.1f} / {hb['p99_ms']:.1f} "
                 f"({hb['n']})"])
    m = r["rss_mib"]
    rows.append(["RSS MiB start / filled / peak reads / peak flood / after",
                 f"{m['start']:.0f} / {m['filled']:.0f} / {m['peak_first_reads']:.0f} / "
                 f"{m['peak_flood']:.0f} / {m['after']:.0f}"])
    rows.append(["RSS growth from reads MiB (goal <= 200)", f"{r['rss_growth_mib']:.0f}"])
    head = (f"{r['jobs']} jobs x {r['attempts']} attempts, filled ({r.get('fill', 'http')}) "
            f"in {r['fill_s']:.0f} s")
    return head + "\n" + text_table(["measure", "value"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--attempts", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30, help="flood duration")
    p.add_argument("--quiet-s", type=float, default=10, help="quiet lookups duration")
    p.add_argument("--senders", type=int, default=6, help="fill threads (write tokens)")
    p.add_argument("--fill", choices=("http", "store"), default="http",
                   help="post the history through the route, or write it into the index "
                        "before the server starts")
    p.add_argument("--readers", type=int, default=2, help="dashboard reload threads")
    p.add_argument("--beaters", type=int, default=4, help="heartbeat threads")
    p.add_argument("--beat-rate", type=float, default=300,
                   help="heartbeats a second in all (six tokens at the default 50/s each)")
    p.add_argument("--keep", action="store_true", help="keep the server's data dir")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "ett_flood.json")
    args = p.parse_args(argv)
    with temp_root("ett-flood-", args.keep) as root:
        result = run(args, root)
    print(table(result))
    write_record(make_record("ett_flood", given_argv(argv), [result]), args.out)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
