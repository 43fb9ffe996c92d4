"""What timing the loop's wait for data costs per batch (ETT's `data_wait`, #50).

The client wraps torch's `DataLoader` iterator `__next__` (`megacache_client/torch/
dataloading.py`). Here the wrapper is timed around a `__next__` whose batch is ready at once
(the wrapper is then all the cost: a real batch, even 32 rows collated in memory, takes
~0.5 ms here), `--calls` calls three ways, interleaved `--repeats` times, median of each:
unwrapped, wrapped with telemetry off (the wrapper asks and calls through), wrapped and
timing (rank 0's loop thread). The cost per batch is set beside a 10 ms training step.

    python -m benchmarks dataloader_bench             # 1,000,000 calls, 7 repeats (~15 s)
    python -m benchmarks dataloader_bench --quick     # 100,000 calls, 3 repeats

Results: a table on stdout, JSON (`--out`, default benchmarks/results/dataloader.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.benchlib import (
    BENCH_DIR,
    log,
    text_table,
)
from benchmarks.harness.record import given_argv, make_record, write_record

STEP_S = 0.010


class _Timing:
    """What the wrapper reads of the telemetry: the loop's thread and the running sum."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()
        self.data_wait_s = 0.0


def per_call_ns(next_batch: Any, calls: int) -> float:
    """ns per call of `next_batch(it)` on an iterator that has its batch ready at once."""
    it = object()
    began = time.perf_counter_ns()
    for _ in range(calls):
        next_batch(it)
    return (time.perf_counter_ns() - began) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "dataloader.json")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.repeats = 100_000, 3
    from megacache_client.ett import dataloading

    def ready(_it: Any) -> int:  # a batch that is there already: the wrapper is all the cost
        return 0

    wrapped = dataloading.timed_next(ready)
    timing = _Timing()
    ways = {"unwrapped": (ready, None), "wrapped, telemetry off": (wrapped, None),
            "wrapped, timing": (wrapped, timing)}
    found: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.repeats):
        for way, (fn, active) in ways.items():  # interleaved: the machine's noise is shared
            dataloading._active = (lambda a=active: a)  # type: ignore[misc]
            found[way].append(per_call_ns(fn, args.calls))
        log(f"repeat {r + 1}/{args.repeats}")
    medians = {w: statistics.median(v) for w, v in found.items()}
    rows = []
    summary = {}
    for way, ns in medians.items():
        extra = ns - medians["unwrapped"]
        share = extra / (STEP_S * 1e9)
        summary[way] = {"ns_per_batch": round(ns, 1), "extra_ns": round(extra, 1),
                        "share_of_10ms_step": share}
        rows.append((way, f"{ns:.0f}", f"{extra:+.0f}", f"{100 * share:.5f}%"))
    print(text_table(("way", "ns per batch", "extra ns", "of a 10 ms step"), rows))
    write_record(make_record("dataloader_bench", given_argv(argv),
                             [{"way": way, **row} for way, row in summary.items()],
                             runs_ns=found), args.out)
    log(f"wrote {args.out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
