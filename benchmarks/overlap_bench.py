"""Compile overlapped with the data loader: does a start cost max(compile, data), not the sum?

    python -m benchmarks overlap_bench --models mlp --repeats 3 --loader-s 5
    python -m benchmarks overlap_bench --quick

A trainer whose DataLoader workers take `--loader-s` seconds to yield their first batch
(`train_job.py --loader-s`: each worker sleeps in its worker_init_fn), timed from process
start to the end of step 1, every job a fresh process on a new machine (empty Inductor,
TMPDIR and node-cache dirs). Scenarios (SCENARIOS): the loader alone (eager), the compile
alone (no loader wait), and the two together without and with `megacache_client.warm_up`,
cold (torch alone, empty caches) and warm (our server filled by one untimed producer job,
the client's defaults). Repeats are interleaved so the machine's noise hits all alike.

The figure that counts: cold+loader+warm_up / max(cold, eager+loader), goal <= 1.10
(GOAL); the same for warm is reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import benchlib
from benchmarks.harness.benchlib import fmt_num, log, median_of_present
from benchmarks.harness.machines import Machine, nothing_loaded, run_job
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.results_md import write_section
from benchmarks.harness.servers import LocalServer

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "overlap.json"
GOAL = 1.10
"""A start with a slow loader and warm_up / max(the compile alone, the loader alone)."""
LOADER = "--loader-s"
SCENARIOS: dict[str, tuple[str, list[str], str]] = {
    # name -> (cache, train_job flags beyond the loader's, what it is)
    "eager+loader": ("cold", ["--eager", LOADER], "no torch.compile, the slow loader: the "
                     "loader alone"),
    "cold": ("cold", [], "torch.compile, empty caches, batches made in the loop: the "
             "compile alone"),
    "cold+loader": ("cold", [LOADER], "both, one after the other (no warm-up)"),
    "cold+loader+warm_up": ("cold", [LOADER, "--warm-up"], "both, the compile on a fast "
                            "batch while the workers start"),
    "warm": ("warm", [], "a new machine on a filled megacache server, batches made in the "
             "loop"),
    "warm+loader": ("warm", [LOADER], "a new machine, the slow loader, no warm-up"),
    "warm+loader+warm_up": ("warm", [LOADER, "--warm-up"], "a new machine, the slow "
                            "loader, warm_up"),
}
IDEAL = {"cold+loader+warm_up": ("cold", "eager+loader"),
         "cold+loader": ("cold", "eager+loader"),
         "warm+loader+warm_up": ("warm", "eager+loader"),
         "warm+loader": ("warm", "eager+loader")}
"""Scenario -> the two whose larger median is its floor: max(compile, loader)."""


@contextlib.contextmanager
def filled_server(root: Path, model: str, needed: bool) -> Iterator[dict[str, str]]:
    """Our server on loopback, filled by one untimed producer job (nothing when no warm
    scenario runs); yields the env that points the warm jobs at it."""
    if not needed:
        yield {}
        return
    server = LocalServer(root / "server" / "data").start(timeout=180)  # busy hosts are slow
    try:
        env = {"MEGACACHE_URL": server.url}
        log(f"{model}: untimed producer")
        run = run_job(Machine(root / "producer"), "--model", model, "--megacache",
                      "explicit", env=env)
        mc = run.result.get("megacache", {})
        log(f"{model}: producer exit {run.returncode}, published {mc.get('published')}")
        shutil.rmtree(root / "producer", ignore_errors=True)
        yield env
    finally:
        server.stop()


def run_one(root: Path, model: str, name: str, r: int, loader_s: float, steps: int,
            env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One job of a scenario on a new machine: its time to the end of step 1, or why not."""
    cache, flags, _what = SCENARIOS[name]
    args = [f if f != LOADER else f"{LOADER}={loader_s}" for f in flags]
    if cache == "warm":
        args += ["--megacache", "explicit"]
    machine = Machine(root / f"r{r}" / name)
    run = run_job(machine, "--model", model, "--steps", str(steps), *args,
                  env=env if cache == "warm" else {}, timeout=timeout)
    shutil.rmtree(machine.root, ignore_errors=True)
    record: dict[str, Any] = {"model": model, "scenario": name, "repeat": r,
                              "wall_s": round(run.wall_s, 3)}
    result = run.result
    if run.returncode != 0 or not result:
        tail = run.stderr.strip().splitlines()
        return {**record, "ok": False,
                "error": f"exit {run.returncode}: {tail[-1] if tail else 'no output'}"}
    record.update(ok=True, tts_s=result["time_to_first_step_s"],
                  compile_s=result["compile_s"], warm_up_s=result.get("warm_up_s"),
                  warm_up_error=result.get("warm_up_error"), counters=result["counters"],
                  marks=result["marks"])
    if cache == "warm":
        record["not_warm"] = nothing_loaded(result) or None
    if run.warnings():
        record["megacache_log"] = run.warnings()[-3:]
    return record


def run_benchmark(root: Path, models: Sequence[str], scenarios: Sequence[str], repeats: int,
                  loader_s: float, steps: int, timeout: float) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    warm = any(SCENARIOS[s][0] == "warm" for s in scenarios)
    for model in models:
        with filled_server(root / model, model, warm) as env:
            for r in range(1, repeats + 1):
                for name in scenarios:
                    log(f"{model} {name} r{r}/{repeats}")
                    job = run_one(root / model, model, name, r, loader_s, steps, env, timeout)
                    log(f"  -> {fmt_num(job.get('tts_s'), '{:.2f}')} s"
                        + ("" if job["ok"] else f" FAILED {job['error']}"))
                    jobs.append(job)
    return jobs


def summarize(jobs: Sequence[dict[str, Any]], models: Sequence[str],
              scenarios: Sequence[str]) -> list[dict[str, Any]]:
    """Per model and scenario: median time to step 1 and its ratio to max(compile, loader)."""
    rows = []
    for model in models:
        med = {name: median_of_present(j.get("tts_s") for j in jobs
                                       if j["model"] == model and j["scenario"] == name)
               for name in scenarios}
        for name in scenarios:
            pair = IDEAL.get(name)
            floor = max(med[p] or 0.0 for p in pair) if pair and all(
                med.get(p) for p in pair) else None
            warm_up = median_of_present(j.get("warm_up_s") for j in jobs
                                        if j["model"] == model and j["scenario"] == name)
            rows.append({"model": model, "scenario": name, "tts_s": med[name],
                         "runs": sum(1 for j in jobs if j["model"] == model
                                     and j["scenario"] == name and j["ok"]),
                         "warm_up_s": warm_up, "floor_s": floor,
                         "vs_floor": benchlib.ratio(med[name] or 0.0, floor or 0.0)
                         if floor and med[name] else None,
                         "goal": GOAL if name == "cold+loader+warm_up" else None})
    return rows


def table(rows: Sequence[dict[str, Any]], markdown: bool) -> str:
    header = ["model", "scenario", "process start -> end of step 1 (s, median)",
              "warm_up (s)", "max(compile, loader) (s)", "/ max"]
    cells = [[r["model"], r["scenario"], fmt_num(r["tts_s"], "{:.2f}"),
              fmt_num(r["warm_up_s"], "{:.2f}"), fmt_num(r["floor_s"], "{:.2f}"),
              fmt_num(r["vs_floor"], "{:.2f}x")
              + (f" (goal <= {r['goal']:.2f})" if r["goal"] else "")] for r in rows]
    return benchlib.markdown_table(header, cells) if markdown \
        else benchlib.text_table(header, cells)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp", help="comma-separated (models.py)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader-s", type=float, default=5.0,
                        help="seconds the loader's workers take to their first batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="one repeat, a 2 s loader, cold scenarios only: does it work")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--write-results", action="store_true",
                        help="also rewrite the `overlap` section of RESULTS.md")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--keep-temp", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.loader_s = 1, 2.0
        args.scenarios = "eager+loader,cold,cold+loader+warm_up"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = given_argv(argv)
    args = parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}: {', '.join(SCENARIOS)}")
    with benchlib.temp_root("overlap-", args.keep_temp) as root:
        jobs = run_benchmark(root, models, scenarios, args.repeats, args.loader_s,
                             args.steps, args.timeout)
    rows = summarize(jobs, models, scenarios)
    print(table(rows, markdown=False))
    report = make_record(
        "overlap_bench", argv, rows,
        goals=[f"a start with a slow loader and warm_up <= {GOAL}x max(compile, loader)"],
        machine=benchlib.machine_info({"torch": "torch"}),
        loader_s=args.loader_s, repeats=args.repeats,
        scenarios={k: v[2] for k, v in SCENARIOS.items() if k in scenarios}, jobs=jobs)
    write_record(report, args.out)
    log(f"wrote {args.out}")
    if args.write_results:
        write_section("overlap", "\n".join([
            "## Compile overlapped with the data loader", "",
            *benchlib.generated_by("overlap_bench.py", argv),
            benchlib.machine_line(report["machine"]),
            f"- torch {report['machine']['torch']}, {report['date']}, loader "
            f"{args.loader_s:g} s, {args.repeats} repeats", "", table(rows, markdown=True)]))
    failed = [j for j in jobs if not j["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
