"""One tenant's read flood (a job's ETT, listings) and what another tenant's lookups pay.

Issue 58, item 1 ("no read costs another tenant"): the sibling of `ett_flood.py` (which
floods the views over many jobs). Against one real server (sqlite index, fs blobs, one
worker, auth off: the two tenants are two clients, so no per-token rate applies and what
is measured is the lane, the worker threads and the byte bound alone):

1. fill: one job of `--attempts` attempts of `--records` records each (posted through
   `POST /v1/jobs/{job}/progress`), and `--entries` manifests of ~60 KB each (blob meta
   values at their 4 KiB cap) through `PUT /v1/ac/{key}`;
2. quiet: the other tenant's exact lookups (`lookup_load.py`, a process of its own) for
   `--quiet-s` seconds, nothing else running;
3. ett flood: `--readers` connections read `GET /v1/jobs/{job}/ett` in a loop for
   `--seconds` while the lookups run;
4. listing flood: `--readers` connections read `GET /v1/ac?limit=1000` in a loop for
   `--seconds` while the lookups run;
5. the server's RSS (its process group) after the fill and its peak during each flood.

A 429 (a view budget's rate) counts as an answer; with auth off there is none.

Goal (issue 58): flooded lookup p99 <= 1.5x quiet, RSS growth under a flood <= 200 MiB.

    python benchmarks/read_flood.py                              # 64 x 56, 1000 entries
    python benchmarks/read_flood.py --entries 200 --seconds 10   # a quick check
"""

from __future__ import annotations

import argparse
import os
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
from benchmarks.ett_flood import RssPeak, group_rss_mib, lookup_ms
from benchmarks.harness.benchlib import BENCH_DIR, log, temp_root, text_table
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer
from benchmarks.scale_bench import Lookups
from megacache_client.wire.manifest import (
    BlobRef,
    Fingerprint,
    Manifest,
    sha256_hex,
)

JOB = "big-job"
FLOODS = ("ett", "listing")


def attempt_records(a: int, records: int, base: float, last: bool) -> list[dict[str, Any]]:
    """Attempt `a`: a start, training, then heartbeats and checkpoint saves to `records`,
    and (but the last attempt) a failure."""
    at = base + a * 4000
    out: list[dict[str, Any]] = [{"kind": "start", "at": at, "allocation_start": at - 5},
                                 {"kind": "training", "at": at + 20}]
    k = 0
    while len(out) < records - 1:
        kind = "heartbeat" if k % 2 == 0 else "checkpoint_save"
        rec: dict[str, Any] = {"kind": kind, "at": at + 30 + k * 60, "step": k * 10}
        if kind == "checkpoint_save":
            rec |= {"blocking_s": 1.0, "background_s": 2.0}
        out.append(rec)
        k += 1
    if not last:
        out.append({"kind": "end", "at": at + 3900, "reason": "failed"})
    return out


def fill_job(url: str, attempts: int, records: int) -> None:
    base = time.time() - attempts * 4000 - 600
    with httpx.Client(base_url=url, timeout=120) as c:
        for a in range(attempts):
            post(c, JOB, a, attempt_records(a, records, base, a == attempts - 1), model="big")


def fill_entries(url: str, entries: int, senders: int = 4) -> int:
    """`entries` manifests of ~60 KB (15 meta values of 4,000 characters); their size."""
    data = os.urandom(64)
    digest = sha256_hex(data)
    meta = {f"note{i}": "x" * 4000 for i in range(15)}
    with httpx.Client(base_url=url, timeout=120) as c:
        c.put(f"/v1/cas/{digest}", content=data).raise_for_status()

    def manifest(i: int) -> Manifest:
        fp = Fingerprint(model=f"model-{i}", code="c", env={"torch": "2.13.0"},
                         hw={"arch": "x86_64"}, config={"mode": "default"})
        return Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0",
                        cold_compile_s=10.0, blobs=[BlobRef(
                            digest=digest, size=len(data), role="megacache",
                            compression="none", meta=meta)])

    def send(part: range) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            for i in part:
                m = manifest(i)
                c.put(f"/v1/ac/{m.key}", content=m.to_json()).raise_for_status()

    step = -(-entries // senders)
    with ThreadPoolExecutor(senders) as pool:
        list(pool.map(send, [range(i, min(entries, i + step))
                             for i in range(0, entries, step)]))
    return len(manifest(0).to_json())


def flood(url: str, path: str, readers: int, stop: threading.Event,
          got: list[tuple[float, int, int]]) -> list[threading.Thread]:
    """`readers` threads reading `path` until `stop`: (seconds, status, bytes) each."""

    def reader() -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.get(path)
                got.append((time.perf_counter() - t, r.status_code, len(r.content)))
                if r.status_code == 429:  # as a client would: wait what it is told
                    stop.wait(float(r.headers.get("retry-after", "1")))

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(readers)]
    for t in threads:
        t.start()
    return threads


def measure(server: LocalServer, args: argparse.Namespace) -> dict[str, Any]:
    assert server.proc is not None
    pgid = server.proc.pid
    rss: dict[str, float] = {"start": group_rss_mib(pgid)}
    log(f"filling one job of {args.attempts} x {args.records} and {args.entries} entries")
    began = time.perf_counter()
    fill_job(server.url, args.attempts, args.records)
    size = fill_entries(server.url, args.entries)
    fill_s = time.perf_counter() - began
    time.sleep(2)
    rss["filled"] = group_rss_mib(pgid)
    log(f"filled in {fill_s:.1f} s (manifests of {size} bytes); RSS {rss['filled']} MiB")
    paths = {"ett": f"/v1/jobs/{JOB}/ett", "listing": "/v1/ac?limit=1000"}
    windows: dict[str, tuple[float, float]] = {}
    reads: dict[str, list[tuple[float, int, int]]] = {}
    with Lookups(server, [SimpleNamespace(key=MISS)]) as lookups:  # type: ignore[list-item]
        q0 = time.perf_counter()
        time.sleep(args.quiet_s)
        windows["quiet"] = (q0, time.perf_counter())
        for name in FLOODS:
            log(f"{name} flood for {args.seconds:g} s")
            stop = threading.Event()
            reads[name] = []
            with RssPeak(pgid) as peak:
                f0 = time.perf_counter()
                threads = flood(server.url, paths[name], args.readers, stop, reads[name])
                time.sleep(args.seconds)
                windows[name] = (f0, time.perf_counter())
                stop.set()
                for t in threads:
                    t.join()
            rss[f"peak_{name}"] = peak.peak
            time.sleep(1)
    quiet = lookup_ms(lookups, *windows["quiet"])
    out: dict[str, Any] = {
        "attempts": args.attempts, "records": args.records, "entries": args.entries,
        "manifest_bytes": size, "readers": args.readers, "fill_s": round(fill_s, 1),
        "lookup_quiet": quiet, "rss_mib": rss}
    for name in FLOODS:
        flooded = lookup_ms(lookups, *windows[name])
        got = reads[name]
        out[name] = {
            "lookup": flooded,
            "lookup_p99_ratio": round(flooded["p99_ms"] / max(quiet["p99_ms"], 1e-9), 2),
            "reads": summary([s for s, status, _ in got if status == 200]),
            "refused_429": sum(1 for _, status, _ in got if status == 429),
            "answer_mib_max": round(max((b for _, _, b in got), default=0) / 2**20, 2),
            "rss_growth_mib": round(rss[f"peak_{name}"] - rss["filled"], 1)}
    return out


def table(r: dict[str, Any]) -> str:
    q = r["lookup_quiet"]
    rows = [["lookup quiet p50 / p99 ms", f"{q['p50_ms']:.1f} / {q['p99_ms']:.1f}", ""]]
    for name in FLOODS:
        f = r[name]
        rows += [
            [f"{name}: lookup flooded p50 / p99 ms",
             f"{f['lookup']['p50_ms']:.1f} / {f['lookup']['p99_ms']:.1f}",
             f"p99 {f['lookup_p99_ratio']:.2f}x quiet (goal <= 1.5)"],
            [f"{name}: reads answered p50 / p99 ms (n), 429s",
             f"{f['reads']['p50_ms']:.0f} / {f['reads']['p99_ms']:.0f} ({f['reads']['n']})",
             f"{f['refused_429']} refused"],
            [f"{name}: largest answer MiB / RSS growth MiB", f"{f['answer_mib_max']:.1f}",
             f"+{f['rss_growth_mib']:.0f} MiB (goal <= 200)"]]
    head = (f"one job of {r['attempts']} x {r['records']} records; {r['entries']} manifests "
            f"of {r['manifest_bytes']} bytes; {r['readers']} readers; filled in "
            f"{r['fill_s']:.0f} s")
    return head + "\n" + text_table(["measure", "value", ""], rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attempts", type=int, default=64)
    p.add_argument("--records", type=int, default=56)
    p.add_argument("--entries", type=int, default=1000)
    p.add_argument("--readers", type=int, default=4, help="flooding connections")
    p.add_argument("--seconds", type=float, default=20, help="each flood's duration")
    p.add_argument("--quiet-s", type=float, default=10, help="quiet lookups duration")
    p.add_argument("--keep", action="store_true", help="keep the server's data dir")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "read_flood.json")
    args = p.parse_args(argv)
    env = {"MEGACACHE_PROGRESS_RATE": "0"}
    with temp_root("read-flood-", args.keep) as root, \
            server_on("sqlite+fs", root, extra_env=env) as server:
        result = measure(server, args)
    print(table(result))
    write_record(make_record("read_flood", given_argv(argv), [result]), args.out)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
