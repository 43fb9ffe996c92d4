"""What the zero-code hook costs every Python process: `python -c pass` with MEGACACHE_URL set.

Every interpreter start in an environment where megacache is installed runs
`megacache_autoload.pth` (pip, DataLoader workers under spawn, helper scripts), so with
MEGACACHE_URL set its cost is paid by processes that never import torch. Goal: the hook
adds at most 5 ms to `python -c pass` (GOAL_MS).

Variants, each a fresh venv (no pip) that sees this checkout and the current environment's
packages through plain path lines, so they differ only in the hook:

- `no hook`: no megacache .pth at all.
- `hook`: `megacache_autoload.pth` as shipped (waits for `import torch`).
- `eager hook (before)`: the previous .pth, which imported the `megacache_client` package
  (httpx, pydantic, zstandard) at start-up.

Runs are interleaved (one of each variant per round) so machine noise hits all alike; the
figure that counts is the median difference to `no hook` within this one run.

    python -m benchmarks startup_bench [--rounds 40] [--out results/startup.json] [--write-results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks.harness.benchlib import markdown_table
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.results_md import write_section

ROOT = Path(__file__).resolve().parent.parent
GOAL_MS = 5.0
EAGER_PTH = 'import os; os.environ.get("MEGACACHE_URL") and __import__("megacache_client")\n'
VARIANTS: dict[str, str | None] = {
    "no hook": None,
    "hook": (ROOT / "megacache_autoload.pth").read_text(),
    "eager hook (before)": EAGER_PTH,
}


def make_venv(where: Path, hook: str | None) -> Path:
    """A pip-less venv that imports this checkout and our packages, plus `hook` as a .pth."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # plain path lines: no .pth of the current environment runs in the variants; the name
    # sorts before megacache_autoload.pth, as an editable install's `_megacache.pth` does
    (site / "_megacache_paths.pth").write_text(
        f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    if hook is not None:
        (site / "megacache_autoload.pth").write_text(hook)
    return python


def time_start(python: Path, env: dict[str, str]) -> float:
    """Wall milliseconds of one `python -c pass`."""
    t0 = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True)
    return (time.perf_counter() - t0) * 1000


def check_hook_is_lazy(python: Path, env: dict[str, str]) -> None:
    """The measured hook must really be installed and waiting, or the figure means nothing."""
    out = subprocess.run([str(python), "-c", "import sys; print(any(type(f).__name__ == "
                          "'TorchImportWatcher' for f in sys.meta_path), "
                          "'megacache_client' in sys.modules)"],
                         env=env, check=True, capture_output=True, text=True).stdout.split()
    if out != ["True", "False"]:
        raise SystemExit(f"the hook variant is not what it claims (watcher, client): {out}")


def run(rounds: int) -> dict:
    env = {**os.environ, "MEGACACHE_URL": "http://127.0.0.1:9"}
    env.pop("PYTHONPATH", None)
    # byte-compiled as pip does at install: with PYTHONDONTWRITEBYTECODE set (as on our
    # machines) a source checkout would otherwise be compiled again at every start
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "megacache_autoload.py"),
                    str(ROOT / "megacache_client")], check=True)
    with tempfile.TemporaryDirectory(prefix="megacache-startup-") as tmp:
        pythons = {name: make_venv(Path(tmp) / f"v{i}", hook)
                   for i, (name, hook) in enumerate(VARIANTS.items())}
        check_hook_is_lazy(pythons["hook"], env)
        for python in pythons.values():  # warm the page cache and .pyc files
            for _ in range(3):
                time_start(python, env)
        times: dict[str, list[float]] = {name: [] for name in pythons}
        for _ in range(rounds):
            for name, python in pythons.items():
                times[name].append(time_start(python, env))
    base = statistics.median(times["no hook"])
    rows = []
    for name, ms in times.items():
        med = statistics.median(ms)
        rows.append({"variant": name, "runs": len(ms), "median_ms": round(med, 2),
                     "p90_ms": round(statistics.quantiles(ms, n=10)[-1], 2),
                     "min_ms": round(min(ms), 2), "added_ms": round(med - base, 2),
                     "vs_no_hook": round(med / base, 3)})
    added = next(r["added_ms"] for r in rows if r["variant"] == "hook")
    return {"measures": "python -c pass, MEGACACHE_URL set",
            "goal_added_ms": GOAL_MS, "hook_added_ms": added, "goal_met": added <= GOAL_MS,
            "rows": rows}


def table(result: dict) -> str:
    return markdown_table(
        ("variant", "runs", "median ms", "p90 ms", "min ms", "added ms (median)", "× no hook"),
        ([r["variant"], str(r["runs"]), f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}",
          f"{r['min_ms']:.1f}", f"{r['added_ms']:+.1f}", f"{r['vs_no_hook']:.2f}"]
         for r in result["rows"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="runs of each variant")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "startup.json")
    parser.add_argument("--write-results", action="store_true",
                        help="also replace the startup section of RESULTS.md")
    args = parser.parse_args(argv)
    measured = run(args.rounds)
    result = make_record(
        "startup_bench", given_argv(argv), measured.pop("rows"),
        goals=[{"goal": f"the hook adds <= {GOAL_MS} ms", "met": measured["goal_met"]}],
        **measured)
    write_record(result, args.out, indent=2)
    print(table(result))
    verdict = "met" if result["goal_met"] else "MISSED"
    print(f"\nhook adds {result['hook_added_ms']:+.1f} ms (median) to `python -c pass` with "
          f"MEGACACHE_URL set; goal <= {GOAL_MS:g} ms: {verdict}. JSON: {args.out}")
    if args.write_results:
        write_section("startup", "## Interpreter start-up with the zero-code hook\n\n"
                      f"`python -m benchmarks startup_bench --rounds {args.rounds}` "
                      f"({result['date']}, {result['machine']['cores']} CPUs, Python "
                      f"{result['machine']['python']}): `python -c pass` with "
                      "MEGACACHE_URL set, interleaved runs.\n\n" + table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
