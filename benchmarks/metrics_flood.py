"""One tenant posts events under N distinct model names; what does a /metrics scrape cost?

    python -m benchmarks metrics_flood            # budgets as configured (the defaults)
    python -m benchmarks metrics_flood --models 2000 --unbounded   # budgets lifted: as before

Runs a loopback server (auth off, event rate limit off), posts `--models` events each with
a new model name (auth off: all in namespace `default`), then scrapes /metrics
and counts its bytes, lines and (namespace, model) series of `megacache_runs`. #47 item 5:
the per-namespace budget (`MEGACACHE_METRICS_MODELS_PER_NAMESPACE`) and the scrape's cap
(`MEGACACHE_METRICS_MODELS`) bound it whatever N is. Prints a table and writes JSON
(default benchmarks/results/metrics_flood.json).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness.benchlib import text_table
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=2000)
    ap.add_argument("--unbounded", action="store_true", help="lift both budgets (as before)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results"
                    / "metrics_flood.json")
    args = ap.parse_args(argv)
    env = {"MEGACACHE_EVENT_RATE": "0"}
    if args.unbounded:
        env |= {"MEGACACHE_METRICS_MODELS_PER_NAMESPACE": "1000000",
                "MEGACACHE_METRICS_MODELS": "1000000"}
    server = LocalServer(Path(tempfile.mkdtemp(prefix="megacache-metrics-")) / "data",
                         env=env).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for i in range(args.models):
                http.post("/v1/events", json={
                    "key": "b" * 64, "model": f"m{i}", "outcome": "hit", "compile_s": 1.0,
                    "cold_compile_s": 30.0, "saved_s": 29.0}).raise_for_status()
            text = http.get("/metrics").text
    finally:
        server.stop()
    series: dict[str, int] = {}
    for f in text_string_to_metric_families(text):
        if f.name == "megacache_runs":
            for ns in {(s.labels["namespace"], s.labels["model"]) for s in f.samples}:
                series[ns[0]] = series.get(ns[0], 0) + 1
    found = {"models_posted": args.models, "unbounded": args.unbounded,
             "scrape_bytes": len(text.encode()), "scrape_lines": len(text.splitlines()),
             "series_by_namespace": series}
    print(text_table(["models posted", "budgets", "bytes", "lines", "series per namespace"],
                     [[str(args.models), "lifted" if args.unbounded else "default",
                       str(found["scrape_bytes"]), str(found["scrape_lines"]), str(series)]]))
    write_record(make_record("metrics_flood", given_argv(argv), [found]), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
