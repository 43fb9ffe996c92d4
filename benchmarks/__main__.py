"""`python -m benchmarks NAME [ARGS...]` runs one benchmark; `--list` names them all.

    python -m benchmarks --list
    python -m benchmarks compile_bench --quick
    python -m benchmarks scale_bench --sizes 10000,100000 --write-results
    python -m benchmarks nightly               # the nightly test tier (pytest -m nightly)

A benchmark is a module of this package (benchmarks/NAME.py) with `main(argv) -> int`;
everything after NAME is its own command line (`--quick`, `--write-results`, `--out`, ...
as `python -m benchmarks NAME --help` lists them). The list is read from the modules'
docstrings without importing them (some import torch).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLAGS = ("--quick", "--write-results")
"""The options a listing marks a benchmark as having (its argparse declares them)."""


def benchmark_names() -> list[str]:
    """Every benchmark: the modules at the top of benchmarks/ (helpers live in harness/)."""
    return sorted(p.stem for p in HERE.glob("*.py") if not p.name.startswith("__"))


def summary(name: str) -> str:
    """The first sentence of benchmark `name`'s docstring (its opening paragraph, which
    may wrap), and the runner's flags it takes."""
    source = (HERE / f"{name}.py").read_text()
    doc = (ast.get_docstring(ast.parse(source)) or "").strip()
    first = " ".join(doc.split("\n\n")[0].split()) if doc else "(no docstring)"
    flags = [f for f in FLAGS if f'"{f}"' in source]
    return first + (f" [{' '.join(flags)}]" if flags else "")


def listing() -> str:
    """One line per benchmark: its name, padded, then what it answers."""
    names = benchmark_names()
    width = max(len(n) for n in names)
    return "\n".join(f"{n.ljust(width)}  {summary(n)}" for n in names)


def run(name: str, argv: Sequence[str]) -> int:
    """Import benchmark `name` and run its main with `argv` (its own command line)."""
    module = importlib.import_module(f"benchmarks.{name}")
    code = module.main(list(argv))
    return int(code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0],
        epilog="Arguments after NAME go to the benchmark: python -m benchmarks NAME --help")
    parser.add_argument("--list", action="store_true", help="every benchmark, one line each")
    parser.add_argument("name", nargs="?", help="the benchmark (see --list)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.list:
        print(listing())
        return 0
    if args.name is None:
        parser.error("name a benchmark (python -m benchmarks --list shows them)")
    name = args.name.removesuffix(".py")
    if name not in benchmark_names():
        parser.error(f"no benchmark {args.name!r}; there are: {', '.join(benchmark_names())}")
    return run(name, args.args)


if __name__ == "__main__":
    sys.exit(main())
