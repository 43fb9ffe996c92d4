"""What a cache server that is down or hung costs a trainer, and the ranks of a node.

    python -m benchmarks hung_server_bench [--ranks 4] [--trainer-repeats 3]
                                           [--out benchmarks/results/hung.json]

First, a trainer (train_job.py: a compiled MLP, 3 steps, cold, zero-code as users run it)
with no URL, with its URL on a port where nothing listens (down: connection refused), and
with its URL on a server that accepts connections and never answers (hung), interleaved,
`--trainer-repeats` each, a new machine every run: seconds from process start to the end of
the first step, and the whole process, with their medians side by side. The client's aim:
down within 0.5 s of no URL for both, hung at most the load deadline (10 s) more.

Then the load step alone, two scenarios side by side against the same hung server, default timeouts
(connect 3 s, read 30 s, 2 retries):

- `no deadline, own breaker`: how the client behaved before the load deadline and the
  node-shared breaker (emulated: a deadline of an hour, a node cache dir per rank);
- `deadline + node breaker`: the defaults (10 s deadline, one breaker file per node).

Each scenario starts `--ranks` processes at once, then as many again once the first wave is
done (ranks that start late, or a second job on the node). Each process only runs the load
step (`Session.load()`), and reports the seconds it waited on the server (load time minus the
fingerprint, which is local work). Prints a table, writes JSON and its RESULTS.md section.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness import TRAIN_JOB
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.results_md import write_section

RANK = """
import json, sys
import megacache_client
from megacache_client.config import ClientConfig
from megacache_client.lifecycle import Session
session = Session(ClientConfig.from_env())
r = session.load()
print(json.dumps({"outcome": r.outcome, "reason": r.reason,
                  "waited_s": r.seconds - r.steps.get("fingerprint", 0.0)}))
"""

SCENARIOS = {
    "no deadline, own breaker": {"MEGACACHE_LOAD_DEADLINE_S": "3600", "own_node": "1"},
    "deadline + node breaker": {},
}


def run_rank(url: str, node: Path, extra: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    env.update({"MEGACACHE_URL": url, "MEGACACHE_NODE_CACHE_DIR": str(node),
                "MEGACACHE_MODEL": "hung-bench", "MEGACACHE_CODE": "v1"})
    env.update({k: v for k, v in extra.items() if k.startswith("MEGACACHE_")})
    out = subprocess.run([sys.executable, "-c", RANK], env=env, capture_output=True,
                         text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"outcome": "crashed", "reason": out.stderr[-500:], "waited_s": float("nan")}
    return dict(json.loads(lines[-1]))


TRAINER_CASES = ("no URL", "down", "hung")


def run_trainer(case: str, hung_url: str, down_url: str, root: Path) -> dict[str, object]:
    """One cold trainer process on a new machine (its own caches), zero-code."""
    from benchmarks.harness.machines import Machine, clean_env

    machine = Machine(root)
    env = clean_env() | machine.env() | {"OMP_NUM_THREADS": "1",
                                         "MEGACACHE_MODEL": "hung-trainer"}
    if case != "no URL":
        env["MEGACACHE_URL"] = hung_url if case == "hung" else down_url
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(TRAIN_JOB), "--model", "mlp", "--steps", "3",
                          "--megacache", "env"], env=env, capture_output=True, text=True,
                         timeout=900)
    whole = time.monotonic() - started
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"case": case, "failed": out.stderr[-500:]}
    result = json.loads(lines[-1])
    return {"case": case, "first_step_s": result["time_to_first_step_s"],
            "process_s": round(whole, 3),
            "outcome": (result.get("megacache") or {}).get("outcome", "off"),
            "warnings": [ln for ln in out.stderr.splitlines() if ln.startswith("megacache:")]}


def trainer_table(hung_url: str, repeats: int, root: Path) -> tuple[list[dict[str, object]],
                                                                   list[dict[str, object]]]:
    """Rows of every trainer run (cases interleaved) and the medians per case."""
    down = socket.socket()
    down.bind(("127.0.0.1", 0))  # bound, never listening: connecting is refused
    down_url = f"http://127.0.0.1:{down.getsockname()[1]}"
    rows = []
    try:
        for r in range(repeats):
            for case in TRAINER_CASES:
                rows.append(run_trainer(case, hung_url, down_url,
                                        root / f"trainer-{r}-{case.replace(' ', '')}"))
                print(f"  trainer {case} #{r + 1}: {rows[-1]}", file=sys.stderr)
    finally:
        down.close()
    summary = []
    base: dict[str, float] = {}
    for case in TRAINER_CASES:
        ok = [r for r in rows if r["case"] == case and "failed" not in r]
        if not ok:
            summary.append({"case": case, "runs": 0})
            continue
        first = statistics.median(float(r["first_step_s"]) for r in ok)  # type: ignore[arg-type]
        whole = statistics.median(float(r["process_s"]) for r in ok)  # type: ignore[arg-type]
        base = base or {"first": first, "whole": whole}
        summary.append({"case": case, "runs": len(ok), "first_step_s": round(first, 2),
                        "process_s": round(whole, 2),
                        "first_step_extra_s": round(first - base["first"], 2),
                        "process_extra_s": round(whole - base["whole"], 2)})
    return rows, summary


def scenario(url: str, root: Path, name: str, extra: dict[str, str], ranks: int
             ) -> list[dict[str, object]]:
    rows = []
    for wave in (1, 2):
        def one(i: int, wave: int = wave) -> dict[str, object]:
            node = root / (f"node-{wave}-{i}" if extra.get("own_node") else "node")
            return {"scenario": name, "wave": wave, "rank": i,
                    **run_rank(url, node, extra)}

        with ThreadPoolExecutor(ranks) as pool:
            rows += list(pool.map(one, range(ranks)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "hung.json")
    parser.add_argument("--no-results-md", action="store_true")
    parser.add_argument("--trainer-repeats", type=int, default=3,
                        help="trainer runs per case (no URL, down, hung); 0 skips them")
    parser.add_argument("--ranks-only", action="store_true",
                        help="only the load step of --ranks processes (the older table)")
    parser.add_argument("--trainer-only", action="store_true",
                        help="only the trainer table (no URL / down / hung)")
    args = parser.parse_args(argv)

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)  # accepts connections, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    trainer_rows: list[dict[str, object]] = []
    trainer_summary: list[dict[str, object]] = []
    if args.trainer_repeats > 0 and not args.ranks_only:
        with tempfile.TemporaryDirectory() as tmp:
            trainer_rows, trainer_summary = trainer_table(url, args.trainer_repeats, Path(tmp))
        head = ("| trainer's server | runs | to end of step 1, s | +s vs no URL | "
                "whole process, s | +s vs no URL |")
        lines = [head, "|---|---|---|---|---|---|"] + [
            f"| {t['case']} | {t['runs']} | {t.get('first_step_s', '-')} | "
            f"{t.get('first_step_extra_s', '-')} | {t.get('process_s', '-')} | "
            f"{t.get('process_extra_s', '-')} |" for t in trainer_summary]
        print("\n".join(lines))
        trainer_md = ("\n\nA cold trainer (compiled MLP, 3 steps, zero-code), medians of "
                      f"{args.trainer_repeats} interleaved runs:\n\n" + "\n".join(lines))
    else:
        trainer_md = ""
    if args.trainer_only:
        listener.close()
        write_record(make_record("hung_server_bench", given_argv(argv), trainer_summary,
                                 trainer_runs=trainer_rows), args.out, indent=2)
        return 0
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(SCENARIOS)) as pool:
        futures = [pool.submit(scenario, url, Path(tmp) / str(n), name, extra, args.ranks)
                   for n, (name, extra) in enumerate(SCENARIOS.items())]
        rows = [row for f in futures for row in f.result()]
    listener.close()

    summary: list[dict[str, Any]] = []
    for name in SCENARIOS:
        for wave in (1, 2):
            waits = [float(r["waited_s"]) for r in rows  # type: ignore[arg-type]
                     if r["scenario"] == name and r["wave"] == wave]
            outcomes = sorted({str(r["outcome"]) for r in rows
                               if r["scenario"] == name and r["wave"] == wave})
            summary.append({"scenario": name, "wave": wave, "ranks": len(waits),
                            "median_wait_s": round(statistics.median(waits), 2),
                            "max_wait_s": round(max(waits), 2), "outcomes": outcomes})
    header = "| scenario | wave | ranks | median wait s | max wait s | outcomes |"
    table = [header, "|---|---|---|---|---|---|"] + [
        f"| {s['scenario']} | {s['wave']} | {s['ranks']} | {s['median_wait_s']} | "
        f"{s['max_wait_s']} | {', '.join(s['outcomes'])} |" for s in summary]
    print("\n".join(table))
    write_record(make_record("hung_server_bench", given_argv(argv), trainer_summary,
                             trainer_runs=trainer_rows, ranks_summary=summary, ranks=rows,
                             wall_s=round(time.monotonic() - started, 1)),
                 args.out, indent=2)
    if not args.no_results_md:
        write_section("hung", "## Hung server: seconds each rank waits before compiling cold\n\n"
                      "`python -m benchmarks hung_server_bench --ranks "
                      f"{args.ranks}`: a server that accepts connections and never answers; "
                      "default timeouts (read 30 s, 2 retries). Wave 2 starts after wave 1 "
                      "is done.\n\n" + "\n".join(table) + trainer_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
