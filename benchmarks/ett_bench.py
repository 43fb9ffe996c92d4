"""Effective Training Time at fleet scale: what 10,000 live jobs heartbeating cost a server.

For each backend (sqlite+fs, redis+s3), against one real server (one worker):

- `--jobs` jobs (default 10,000) start: each reports a start, its first step and a
  heartbeat (`POST /v1/jobs/{job}/progress`, rank 0 of each job);
- entry lookups (GET /v1/ac/{key}, a miss: one index read) one at a time, p50/p99, without
  heartbeats and then while every job heartbeats every `--period` seconds (default 30,
  spread: `jobs / period` batches a second, from `--senders` threads), a checkpoint save
  every tenth beat (goal: lookup p99 under load ≤ 1.1× without);
- `GET /v1/dashboard` and `GET /metrics` p50/p99 with those jobs (goal: p99 ≤ 100 ms);
- one simulated job's timeline (a start, checkpoints, a failure, a restore, a recovery),
  split by the server, drawn as a stacked bar per attempt (`ett_bench.png`).

Results: a table on stdout, JSON (`--out`, default benchmarks/results/ett_bench.json).

    python -m benchmarks ett_bench                       # 10,000 jobs, both backends
    python -m benchmarks ett_bench --quick               # 200 jobs: checks the script works
    python -m benchmarks ett_bench --flush-s 0,1         # beats written one by one, then
                                                         # coalesced (a row each)
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.benchlib import (
    BENCH_DIR,
    log,
    percentile,
    pyplot,
    save_figure,
    temp_root,
    text_table,
)
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalRedis, LocalSeaweedS3, LocalServer

CATEGORIES = ("training", "startup", "compile", "checkpoint_save", "checkpoint_restore",
              "lost_progress", "recovery", "idle")
COLORS = ("#12b76a", "#98a2b3", "#f79009", "#2e90fa", "#84caff", "#f04438", "#9e77ed",
          "#e4e7ec")
MISS = "0" * 64


@contextmanager
def server_on(backend: str, root: Path, flush_s: str = "",
              extra_env: dict[str, str] | None = None) -> Iterator[LocalServer]:
    with ExitStack() as stack:
        env: dict[str, str] = {"MEGACACHE_PROGRESS_FLUSH_S": flush_s} if flush_s else {}
        env |= extra_env or {}
        if backend == "redis+s3":
            redis = LocalRedis(root / "redis").start()
            stack.callback(redis.stop)
            s3 = LocalSeaweedS3(root / "seaweed").start()
            stack.callback(s3.stop)
            env |= {"MEGACACHE_INDEX": redis.url, "MEGACACHE_BLOB_STORE": "s3",
                   "MEGACACHE_S3_ENDPOINT": s3.endpoint, "MEGACACHE_S3_BUCKET": "ett",
                   "MEGACACHE_S3_CREATE_BUCKET": "true", "AWS_ACCESS_KEY_ID": "test",
                   "AWS_SECRET_ACCESS_KEY": "test"}
        server = LocalServer(root / "data", env=env).start(timeout=90)
        stack.callback(server.stop)
        yield server


def post(c: httpx.Client, job: str, attempt: int, records: list[dict[str, Any]],
         model: str | None = None) -> float:
    body: dict[str, Any] = {"attempt": attempt, "records": records}
    if model:
        body["model"] = model
    t = time.perf_counter()
    r = c.post(f"/v1/jobs/{job}/progress", json=body)
    if r.status_code != 202:
        raise RuntimeError(f"progress: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - t


def start_jobs(url: str, jobs: int, senders: int) -> float:
    """Every job's start, first step and first heartbeat; seconds it took."""
    now = time.time()
    began = time.perf_counter()

    def send(part: range) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            for j in part:
                at = now - 600 + (j % 300)
                post(c, f"job-{j}", 0, [{"kind": "start", "at": at},
                                        {"kind": "training", "at": at + 60},
                                        {"kind": "heartbeat", "at": now, "step": 1}],
                     model=f"model-{j % 20}")

    step = -(-jobs // senders)
    with ThreadPoolExecutor(senders) as pool:
        list(pool.map(send, [range(i, min(jobs, i + step)) for i in range(0, jobs, step)]))
    return time.perf_counter() - began


def latencies(c: httpx.Client, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = c.get(path)
        out.append(time.perf_counter() - t)
        if r.status_code not in (200, 404):
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
    return out


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": round(percentile(values, 0.5) * 1000, 3),
            "p99_ms": round(percentile(values, 0.99) * 1000, 3)}


class Heartbeats:
    """Every job beats once per `period`, spread evenly, from `senders` threads; every tenth
    beat of a job also reports a checkpoint save."""

    def __init__(self, url: str, jobs: int, period: float, senders: int) -> None:
        self.url, self.jobs, self.period, self.senders = url, jobs, period, senders
        self.stop = threading.Event()
        self.sent: list[float] = []
        self.late = 0
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(senders)]

    def __enter__(self) -> Heartbeats:
        self.began = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.seconds = time.perf_counter() - self.began

    def _run(self, k: int) -> None:
        mine = list(range(k, self.jobs, self.senders))
        gap = self.period / max(1, len(mine))
        beat = 0
        with httpx.Client(base_url=self.url, timeout=60) as c:
            due = time.perf_counter() + gap * (k / self.senders)
            while not self.stop.is_set():
                j = mine[beat % len(mine)]
                wait = due - time.perf_counter()
                if wait > 0:
                    self.stop.wait(wait)
                else:
                    self.late += 1
                now = time.time()
                records = [{"kind": "heartbeat", "at": now, "step": 2 + beat}]
                if beat % 10 == 9:
                    records.append({"kind": "checkpoint_save", "at": now - 1, "step": beat,
                                    "blocking_s": 0.8})
                self.sent.append(post(c, f"job-{j}", 0, records))
                beat += 1
                due += gap


def simulated_job(c: httpx.Client) -> dict[str, Any]:
    """One job with a failure, its timeline made up, split by the server."""
    b = time.time() - 3600
    post(c, "timeline", 0, [
        {"kind": "start", "at": b + 30, "allocation_start": b},
        {"kind": "training", "at": b + 240},
        *({"kind": "checkpoint_save", "at": b + 600 + 600 * k, "step": 100 * k,
           "blocking_s": 25.0} for k in range(3)),
        {"kind": "heartbeat", "at": b + 2150, "step": 400}], model="timeline")
    post(c, "timeline", 1, [
        {"kind": "start", "at": b + 2300},
        {"kind": "checkpoint_load", "at": b + 2380, "blocking_s": 40.0, "step": 300},
        {"kind": "training", "at": b + 2500},
        {"kind": "checkpoint_save", "at": b + 3000, "step": 500, "blocking_s": 25.0},
        {"kind": "end", "at": b + 3500, "reason": "finished"}])
    return dict(c.get("/v1/jobs/timeline/ett").json())


def run_backend(backend: str, args: argparse.Namespace, root: Path,
                flush_s: str = "") -> dict[str, Any]:
    with server_on(backend, root, flush_s) as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:
        log(f"{backend}: starting {args.jobs} jobs")
        started_s = start_jobs(server.url, args.jobs, args.senders)
        idle = latencies(c, f"/v1/ac/{MISS}", args.lookups)
        log(f"{backend}: heartbeats for {args.duration:g} s "
            f"({args.jobs / args.period:.0f} a second)")
        with Heartbeats(server.url, args.jobs, args.period, args.senders) as beats:
            time.sleep(min(2.0, args.duration / 4))
            busy: list[float] = []
            end = time.perf_counter() + args.duration
            while time.perf_counter() < end:
                busy += latencies(c, f"/v1/ac/{MISS}", 50)
        dashboard = latencies(c, "/v1/dashboard", args.reads)
        metrics = latencies(c, "/metrics", args.reads)
        timeline = simulated_job(c)
    row = {"backend": backend, "flush_s": float(flush_s) if flush_s else None,
           "jobs": args.jobs, "start_s": round(started_s, 3),
           "lookup_idle": summary(idle), "lookup_heartbeats": summary(busy),
           "heartbeats": {**summary(beats.sent),
                          "per_s": round(len(beats.sent) / beats.seconds, 1),
                          "wanted_per_s": round(args.jobs / args.period, 1),
                          "late": beats.late},
           "dashboard": summary(dashboard), "metrics": summary(metrics),
           "timeline": timeline}
    row["lookup_p99_ratio"] = round(row["lookup_heartbeats"]["p99_ms"]
                                    / max(row["lookup_idle"]["p99_ms"], 1e-9), 3)
    return row


def plot(timeline: dict[str, Any], path: Path) -> None:
    """The job's wall time in order (the server's `timeline`), one colour per category."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 2.2))
    color = dict(zip(CATEGORIES, COLORS, strict=True))
    origin = timeline["start"]
    for start, end, category in timeline["timeline"]:
        ax.barh(0, end - start, left=start - origin, color=color[category], height=0.5)
    for a in timeline["attempts"][1:]:
        ax.axvline(a["start"] - origin, color="black", lw=0.8, ls=":")
    ax.set_yticks([])
    ax.set_xlabel(f"seconds since allocation: ETT {timeline['ett_pct']}%, "
                  f"{timeline['failures']} failure (dotted: the next attempt's zone)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[c]) for c in CATEGORIES]
    ax.legend(handles, CATEGORIES, ncol=4, fontsize="small", loc="lower center",
              bbox_to_anchor=(0.5, 1.02), frameon=False)
    save_figure(plt, fig, path, 120)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--period", type=float, default=30.0, help="seconds between a job's beats")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of heartbeats")
    p.add_argument("--senders", type=int, default=8)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--reads", type=int, default=30, help="dashboard and /metrics reads")
    p.add_argument("--backends", default="sqlite+fs,redis+s3")
    p.add_argument("--flush-s", default="", help="MEGACACHE_PROGRESS_FLUSH_S of the server, "
                   "comma-separated for a row each in one run (0,1: heartbeats written one "
                   "by one vs coalesced); default: the server's default")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "ett_bench.json")
    p.add_argument("--quick", action="store_true", help="200 jobs, 5 s: checks the script")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.duration, args.lookups, args.reads, args.period = 200, 5.0, 200, 5, 5.0
    rows = []
    with temp_root("ett-bench", args.keep) as root:
        for backend in args.backends.split(","):
            for flush_s in args.flush_s.split(","):
                rows.append(run_backend(backend, args, root / f"{backend.replace('+', '-')}"
                                        f"-{flush_s or 'default'}", flush_s))
    write_record(make_record("ett_bench", given_argv(argv), rows), args.out)
    plot(rows[0]["timeline"], args.out.with_suffix(".png"))
    print(text_table(
        ("backend", "flush s", "jobs", "beats/s", "lookup p99 idle ms", "lookup p99 beating ms",
         "ratio", "dashboard p50/p99 ms", "metrics p50/p99 ms"),
        [(r["backend"], "default" if r["flush_s"] is None else f"{r['flush_s']:g}",
          str(r["jobs"]), f"{r['heartbeats']['per_s']:g}",
          f"{r['lookup_idle']['p99_ms']:.2f}", f"{r['lookup_heartbeats']['p99_ms']:.2f}",
          f"{r['lookup_p99_ratio']:.2f}",
          f"{r['dashboard']['p50_ms']:.0f}/{r['dashboard']['p99_ms']:.0f}",
          f"{r['metrics']['p50_ms']:.0f}/{r['metrics']['p99_ms']:.0f}") for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
