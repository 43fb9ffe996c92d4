"""What the background scrub costs lookups: entry-lookup latency with the scrub off and on.

    python -m benchmarks scrub_bench --write-results
    python -m benchmarks scrub_bench --quick     # small store, few lookups: checks it works

One store (SQLite + local disk) of `--blobs` blobs of `--blob-mib` MiB, each named by an
entry, is served by a fresh server per phase, the phases alternating `--rounds` times so
background noise hits both alike: `off` (MEGACACHE_SCRUB_BYTES_PER_S=0, the embedded
default) and `on` (the scrub re-hashing at `--rate` with MEGACACHE_SCRUB_INTERVAL_S=0, so
it never runs out of work during the phase). In each phase one client looks the entries up
in turn (`GET /v1/ac/{key}`, keep-alive) `--lookups` times. Printed and written (JSON and
the RESULTS.md `scrub` section): p50/p99/max lookup latency per phase, the p99 ratio on/off,
and the scrub's progress (the age of the longest-unverified blob at the end of the phase,
from `/metrics`: small when the scrub ran, the time since upload when it did not).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.benchlib import (
    generated_by,
    log,
    machine_line,
    markdown_table,
    percentile,
    temp_root,
    text_table,
)
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.results_md import write_section
from benchmarks.harness.servers import LocalServer
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest
from megacache_client.wire.schema import parse

BENCH_DIR = Path(__file__).resolve().parent

DEFAULT_OUT = BENCH_DIR / "results" / "scrub.json"
PHASES = {"off": {"MEGACACHE_SCRUB_BYTES_PER_S": "0"},
          "on": {"MEGACACHE_SCRUB_INTERVAL_S": "0"}}


def populate(server: LocalServer, blobs: int, size: int) -> list[str]:
    """`blobs` random blobs, one entry each; returns the entry keys."""
    keys = []
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for i in range(blobs):
            data = os.urandom(size)
            digest = hashlib.sha256(data).hexdigest()
            assert c.put(f"/v1/cas/{digest}", content=data).status_code in (200, 201)
            fp = parse(Fingerprint, {"model": "scrub-bench", "code": f"c{i}",
                                     "env": {"torch": "2.13.0"}, "hw": {"arch": "x86_64"}})
            m = Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0",
                         blobs=[BlobRef(digest=digest, size=size, role="megacache",
                                        compression="none")],
                         artifact_counts={"inductor": 1}, cold_compile_s=1.0,
                         created_at=datetime.now(timezone.utc), producer={"client": "bench"})
            r = c.put(f"/v1/ac/{m.key}", content=m.to_json())
            assert r.status_code in (200, 201), r.text
            keys.append(m.key)
    return keys


def oldest_unverified_s(url: str) -> float | None:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("megacache_scrub_oldest_unverified_seconds "):
            return float(line.split()[1])
    return None


def phase(data_dir: Path, env: dict[str, str], keys: list[str], lookups: int,
          settle_s: float) -> dict[str, Any]:
    """One server on the store; lookup latencies (ms) while it runs with `env`."""
    with LocalServer(data_dir, env=env) as server:
        time.sleep(settle_s)  # the scrub's first blobs are being hashed
        times = []
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(lookups):
                started = time.perf_counter()
                r = c.get(f"/v1/ac/{keys[i % len(keys)]}")
                times.append((time.perf_counter() - started) * 1000)
                assert r.status_code == 200, r.text
        return {"ms": times, "oldest_unverified_s": oldest_unverified_s(server.url)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blobs", type=int, default=64)
    p.add_argument("--blob-mib", type=int, default=8)
    p.add_argument("--rate", default="64MiB", help="the scrub's budget, bytes per second")
    p.add_argument("--lookups", type=int, default=3000, help="per phase")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8 blobs of 1 MiB, 200 lookups")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--write-results", action="store_true",
                   help="also rewrite the scrub section of RESULTS.md")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)
    if args.quick:
        args.blobs, args.blob_mib, args.lookups, args.rounds = 8, 1, 200, 1
    settle_s = 0.5 if args.quick else 2.0
    ms: dict[str, list[float]] = {name: [] for name in PHASES}
    oldest: dict[str, list[float | None]] = {name: [] for name in PHASES}
    with temp_root("scrub_bench.", args.keep) as root:
        data_dir = root / "data"
        with LocalServer(data_dir) as server:
            keys = populate(server, args.blobs, args.blob_mib << 20)
        log(f"store: {args.blobs} blobs of {args.blob_mib} MiB, one entry each")
        for r in range(1, args.rounds + 1):
            for name, env in PHASES.items():
                env = {**env, **({"MEGACACHE_SCRUB_BYTES_PER_S": args.rate}
                                 if name == "on" else {})}
                got = phase(data_dir, env, keys, args.lookups, settle_s)
                ms[name] += got["ms"]
                oldest[name].append(got["oldest_unverified_s"])
                log(f"round {r}/{args.rounds} scrub {name}: p99 "
                    f"{percentile(got['ms'], 0.99):.2f} ms")
    rows: list[dict[str, Any]] = []
    for name in PHASES:
        rows.append({"scrub": name, "lookups": len(ms[name]),
                     "p50_ms": round(percentile(ms[name], 0.5), 3),
                     "p99_ms": round(percentile(ms[name], 0.99), 3),
                     "max_ms": round(max(ms[name]), 3),
                     "oldest_unverified_s": oldest[name]})
    ratio = rows[1]["p99_ms"] / rows[0]["p99_ms"] if rows[0]["p99_ms"] else None
    header = ["scrub", "lookups", "p50 ms", "p99 ms", "max ms", "oldest unverified s (per round)"]
    cells: list[list[str]] = [
        [r["scrub"], str(r["lookups"]), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
         f"{r['max_ms']:.1f}",
         ", ".join("-" if v is None else f"{v:.0f}" for v in r["oldest_unverified_s"])]
        for r in rows]
    print(text_table(header, cells))
    print(f"p99 with the scrub on / off: {ratio:.2f}x" if ratio else "p99 ratio: n/a")
    report = make_record("scrub_bench", given_argv(argv), rows, rate=args.rate,
                         blobs=args.blobs, blob_mib=args.blob_mib, p99_ratio=ratio)
    write_record(report, args.out)
    if args.write_results:
        lines = ["## The scrub's cost on lookups", "", *generated_by("scrub_bench.py",
                                                                      report["argv"]),
                 f"- date: {report['date']}", machine_line(report["machine"]),
                 f"- store: {args.blobs} blobs of {args.blob_mib} MiB (SQLite + disk); scrub "
                 f"budget {args.rate}/s with no interval (always working); {args.rounds} "
                 f"rounds of {args.lookups} lookups per phase, phases alternating", "",
                 markdown_table(header, cells), "",
                 f"p99 with the scrub on / off: {ratio:.2f}x" if ratio else ""]
        write_section("scrub", "\n".join(lines))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
