"""The one results record every benchmark writes, and where it goes.

A reader of `benchmarks/results/*.json` (a person, RESULTS.md's renderers, a test) finds
the same fields first in every file: which benchmark, the arguments it ran with, when, on
which machine and torch, its goals (each met or not) and its rows (the figures its table
shows). What only one benchmark has (its raw jobs, its chart, its settings) follows under
names of its own. One helper makes it, so the fields cannot drift apart again.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import BENCH_DIR
from benchmarks.harness.benchlib import machine_info, package_version, utc_now, write_json

RESULTS = BENCH_DIR / "results"
"""Where the records live (a benchmark's `--out` may put one elsewhere)."""

FIELDS = ("benchmark", "argv", "date", "machine", "torch", "goals", "rows")
"""The fields every record opens with, in this order."""


def given_argv(argv: Sequence[str] | None) -> list[str]:
    """The arguments a benchmark's `main(argv)` got: `argv`, or the command line's when
    run as a script (`main()` with None, argparse's own convention)."""
    return list(sys.argv[1:] if argv is None else argv)


def make_record(benchmark: str, argv: Sequence[str], rows: Any, *,
                goals: Sequence[Any] = (), machine: Mapping[str, Any] | None = None,
                date: str | None = None, **fields: Any) -> dict[str, Any]:
    """The record of one run of `benchmark` (its module's name, as `python -m benchmarks`
    takes it): the common fields, then the benchmark's own `fields`. `machine` defaults
    to benchlib.machine_info(); a benchmark that knows more (tool versions) passes its own."""
    clash = set(fields) & set(FIELDS)
    if clash:
        raise ValueError(f"{benchmark}: {sorted(clash)} are the record's own fields")
    return {"benchmark": benchmark, "argv": list(argv), "date": date or utc_now(),
            "machine": dict(machine) if machine is not None else machine_info(),
            "torch": package_version("torch"), "goals": list(goals), "rows": rows, **fields}


def default_out(benchmark: str) -> Path:
    """`benchmarks/results/<benchmark>.json`, for a benchmark without a name of its own."""
    return RESULTS / f"{benchmark}.json"


def write_record(record: Mapping[str, Any], out: Path | None = None,
                 indent: int = 1) -> Path:
    """Write `record` (made by make_record) as JSON at `out` (default_out when None)."""
    missing = [f for f in FIELDS if f not in record]
    if missing:
        raise ValueError(f"not a results record, missing {missing}")
    path = out if out is not None else default_out(str(record["benchmark"]))
    write_json(path, dict(record), indent=indent)
    return path
