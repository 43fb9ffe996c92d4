"""Blob and entry throughput of megacache-server, side by side with nginx and Redis.

    python -m benchmarks server_bench              # full run, ~6 min; writes results + RESULTS.md
    python -m benchmarks server_bench --quick      # smoke test: 1 MiB, 1 and 16 readers
    python -m benchmarks server_bench --sizes 64MiB --readers 16 --repeats 5

What a job start looks like to the cache: every rank asks for the same bundle at once. For
each blob size and reader count, N connections fetch the same blob in a loop for a few
seconds, from

- ours:  `python -m megacache_server --workers 2 --log-level warning` (the Docker image's
         worker count), GET /v1/cas/{digest};
- nginx: the Debian package, `sendfile on; tcp_nopush on;`, 2 workers, serving the very
         file our server stored: the practical limit of this machine;
- redis: GET of the same bytes (sizes up to 64 MiB).

Plus PUT throughput (ours vs. nginx's DAV module writing the same bytes to disk) and the
latency of an entry lookup (GET /v1/ac/{key}) under 32 concurrent clients (wrk; nginx serving
the same manifest bytes as a static file for reference). Everything binds 127.0.0.1.

Repeats are interleaved (each repeat measures every target, in alternating order) so that
background load, e.g. a compile benchmark on the same 2 cores, hits all targets alike; the
figure of merit is the ratio ours / nginx within one run.

The blob load generator is in serverbench/gets.py, not wrk: wrk reads 8 KiB per syscall
and parses every byte, so it saw ~2.3 GB/s from nginx at 16 readers where ours sees ~4.2
(bodies dropped in the kernel, one process per core; its own CPU use is recorded next to
the server's for every measurement).

This file is the entry point: the command line, the order of the jobs and the report.
The jobs, the services and the outputs are in serverbench/ (see its __init__.py).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.benchlib import (
    BENCH_DIR,
    LOOPBACK,
    REPO,
    MiB,
    log,
    machine_info,
    parse_list,
    parse_size,
    temp_root,
)
from benchmarks.harness.record import make_record, write_record
from benchmarks.harness.results_md import write_section
from benchmarks.harness.servers import redis_server_exe
from benchmarks.serverbench.fixtures import create_entry, make_blob, put_fixture
from benchmarks.serverbench.gets import run_gets
from benchmarks.serverbench.lookups import LOOKUP_CLIENTS, run_lookups
from benchmarks.serverbench.measure import Bench
from benchmarks.serverbench.puts import put_targets, run_puts
from benchmarks.serverbench.report import (
    goals,
    render_goals,
    render_section,
    render_tables,
    write_chart,
)
from benchmarks.serverbench.services import (
    WORKERS,
    nginx_service,
    ours_service,
    py_spy,
    redis_service,
)

DEFAULT_OUT = BENCH_DIR / "results" / "server.json"


def run_benchmark(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Start the three services, create the fixtures, run every measurement."""
    bench = Bench(root, args.duration, args.put_duration, args.repeats, args.max_uploads)
    fixtures = root / "fixtures"
    fixtures.mkdir()
    sizes = sorted(set(args.sizes) | {args.put_size})
    log(f"temp root {root}; writing fixtures of {', '.join(f'{s // MiB} MiB' for s in sizes)}")
    blobs = {size: make_blob(fixtures / f"{size}.bin", size) for size in sizes}
    data_dir = root / "ours" / "data"
    with contextlib.ExitStack() as stack:
        ours, server = stack.enter_context(ours_service(data_dir))
        for blob in blobs.values():
            put_fixture(ours.port, blob)
        key, manifest_json = create_entry(server, blobs[min(sizes)])
        nginx = stack.enter_context(nginx_service(root / "nginx", data_dir))
        (root / "nginx" / "static" / "manifest.json").write_bytes(manifest_json)
        services = {"ours": ours, "nginx": nginx}
        if not args.no_redis:
            redis = stack.enter_context(redis_service(root / "redis"))
            if redis is not None:
                services["redis"] = redis
        log(f"ours on :{ours.port} (pids {ours.pids}), nginx on :{nginx.port} "
            f"(pids {nginx.pids})" + (f", redis on :{services['redis'].port}"
                                      if "redis" in services else ""))
        if args.profile_ours:
            stack.enter_context(py_spy(ours, Path(args.profile_ours)))

        gets = run_gets(bench, {s: blobs[s] for s in args.sizes}, args.readers, services) \
            if "get" in args.jobs else []
        lookups = run_lookups(bench, {
            "ours": (f"{server.url}/v1/ac/{key}", ours),
            "healthz": (f"{server.url}/healthz", ours),
            "nginx": (f"http://{LOOPBACK}:{nginx.port}/static/manifest.json", nginx),
        }, LOOKUP_CLIENTS) if "lookup" in args.jobs else []
        puts = run_puts(bench, blobs[args.put_size], args.put_uploaders,
                        put_targets(ours, nginx, data_dir, root / "nginx")) \
            if "put" in args.jobs else []
    return {"get": gets, "put": puts, "lookup": lookups,
            "manifest_bytes": len(manifest_json), "load_avg_1min": bench.load_avg}


def server_machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, RAM, kernel, and the servers' versions."""
    info = machine_info(
        packages={name: name for name in ("uvicorn", "uvloop", "httptools", "starlette")},
        tools={"nginx": ["nginx", "-v"], "wrk": ["wrk", "--version"],
               "redis_server": [redis_server_exe() or "redis-server", "--version"]})
    if info["wrk"]:
        info["wrk"] = re.sub(r"\s*Copyright.*", "", info["wrk"])
    return info


# -- command line ------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=parse_list(parse_size),
                        default=[1 * MiB, 64 * MiB, 512 * MiB], help="blob sizes (1MiB,64MiB)")
    parser.add_argument("--readers", type=parse_list(int), default=[1, 16, 64],
                        help="concurrent readers of one blob")
    parser.add_argument("--put-size", type=parse_size, default=64 * MiB)
    parser.add_argument("--put-uploaders", type=parse_list(int), default=[1, 4])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--put-duration", type=float, default=4.0)
    parser.add_argument("--max-uploads", type=int, default=200,
                        help="uploads per uploader per measurement at most")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", default="get,lookup,put",
                        help="which measurements to run (get,lookup,put); a partial run "
                             "never rewrites RESULTS.md")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 MiB, 1 and 16 readers, 1 repeat of 1 s")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis reference")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON results, the chart next to it as .png (default "
                             f"{DEFAULT_OUT.relative_to(REPO)}; --quick: none)")
    parser.add_argument("--no-results-md", action="store_true",
                        help="do not rewrite the server section of benchmarks/RESULTS.md "
                             "(--quick never does)")
    parser.add_argument("--profile-ours", metavar="DIR",
                        help="py-spy record each uvicorn worker for the whole run into DIR")
    parser.add_argument("--keep-temp", action="store_true", help="keep the temp root")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.readers, args.put_size = [1 * MiB], [1, 16], 1 * MiB
        args.put_uploaders, args.repeats = [1], 1
        args.duration = args.put_duration = 1.0
        args.no_results_md = True  # a smoke test never replaces the published numbers
    elif args.out is None:
        args.out = DEFAULT_OUT
    args.jobs = [j for j in args.jobs.split(",") if j]
    if unknown := set(args.jobs) - {"get", "lookup", "put"}:
        parser.error(f"unknown job(s) {', '.join(sorted(unknown))}: choose from get,lookup,put")
    if set(args.jobs) != {"get", "lookup", "put"}:
        args.no_results_md = True
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            parser.error(f"{tool} is not installed (Debian: apt-get install -y nginx wrk)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    with temp_root("server_bench.", args.keep_temp) as root:
        measured = run_benchmark(args, root)
    tables = {job: measured.pop(job) for job in ("get", "put", "lookup")}
    report = make_record(
        "server_bench", argv, tables, machine=server_machine_info(), workers=WORKERS,
        log_level="warning", repeats=args.repeats, duration_s=args.duration,
        put_duration_s=args.put_duration, **measured)
    report["goals"] = goals(report)
    print(render_tables(report))
    print()
    print(render_goals(report))
    chart: Path | None = None
    if args.out is not None:
        write_record(report, args.out)
        chart = args.out.with_suffix(".png")
        if not write_chart(report, chart):
            chart = None
        log(f"wrote {args.out}" + (f", {chart}" if chart else ""))
    if not args.no_results_md:
        write_section("server", render_section(report, chart))
        log("wrote the server section of benchmarks/RESULTS.md")
    errors = sum(r[t]["errors"] for r in tables["get"] + tables["put"]
                 for t in ("ours", "nginx", "redis") if t in r)
    errors += sum(r["errors"] for r in tables["lookup"])
    if errors:
        log(f"{errors} failed requests: see {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
