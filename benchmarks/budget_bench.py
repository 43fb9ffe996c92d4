"""The budget of a new machine: process start -> end of step 1, part by part, against eager.

    python benchmarks/budget_bench.py [--models mlp,transformer | all] [--repeats 3]

Issue 48: a new machine (fresh local caches, warm server, client defaults) should start
within 1.1x of the same trainer without torch.compile (eager) on the MLP, 1.25x on the
corpus. This bench says where the gap goes. Per repeat it runs, interleaved so machine
noise hits all alike: eager, new machine, cold (torch alone, empty caches; for the share of
compile overhead removed, (cold - new) / (cold - eager)). Every job is a fresh
train_job.py process with its own cache dirs (compile_bench.Bench).

The parts come from timestamps the job and the client already record: train_job's marks
(torch imported, client enabled, model built, compile called, first step end), the load's
own step timer (LoadResult.steps: fingerprint, lookups, download, unpack, placing, bundle
load...) and torch's compile seconds. `exit` is the whole process wall minus the end of
step 1: what the close and interpreter exit add.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib  # benchmarks/benchlib.py, next to this script
from benchlib import log
from benchlib import median_of_present as median
from compile_bench import Bench, local_job, megacache_service
from jobs import GxxCounter

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "budget.json"
CORPUS = ("mlp", "transformer", "dlrm", "conv", "gpt2")
DEFAULT_MODELS = ("mlp", "transformer")
KINDS = ("eager", "new", "cold")


def new_machine(bench: Bench, model: str, env: dict[str, str], where: str) -> dict[str, Any]:
    """The client's defaults on a machine with empty local caches."""
    return bench.run(bench.machine(model, where, "new"), {**env, "MEGACACHE_MODEL": model},
                     ["--model", model, "--megacache", "explicit"])


def parts(job: dict[str, Any]) -> dict[str, float | None]:
    """Seconds of each part of one job's start (None where the job has no such part)."""
    marks = job.get("marks", {})
    tts = job.get("time_to_first_step_s")
    mc = job.get("megacache") or {}
    out: dict[str, float | None] = {
        "imports": marks.get("torch_imported_s"),
        "client enable": _gap(marks, "initialised_s", "torch_imported_s"),
        "build model": _gap(marks, "built_s", "initialised_s"),
        "optimizer (imports torch._dynamo)": _gap(marks, "optimizer_s", "built_s"),
        "torch.compile call (client load)": _gap(marks, "compile_called_s", "optimizer_s"),
    }
    tts_parts = mc.get("tts") or {}
    out["client: load (on first compile)"] = tts_parts.get("tts_load_s")
    for name, secs in (mc.get("load_steps") or {}).items():
        out[f"  load: {name}"] = secs
    out["client: fetch wait"] = tts_parts.get("tts_fetch_s")
    out["torch compile"] = job.get("compile_s") if job.get("compile_s") else None
    out["first step"] = job.get("first_step_s")
    out["to end of step 1"] = tts
    out["exit"] = round(job["wall_s"] - tts, 3) if tts is not None else None
    out["process"] = job.get("wall_s")
    return out


def _gap(marks: dict[str, float], late: str, early: str) -> float | None:
    if late in marks and early in marks:
        return round(marks[late] - marks[early], 3)
    return None


def run(bench: Bench, models: Sequence[str], repeats: int) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    with megacache_service(bench.root / "server") as env:
        for model in models:
            log(f"{model}: untimed producer")
            produced = new_machine(bench, model, env, "producer")
            log(f"{model}: producer ok={produced.get('ok')}")
            for r in range(1, repeats + 1):
                for kind in KINDS:
                    if kind == "new":
                        record = new_machine(bench, model, env, f"r{r}")
                    else:
                        record = local_job(bench, model, kind, r,
                                           bench.machine(model, f"r{r}", "cold"))
                    log(f"{model} {kind} r{r}: ok={record.get('ok')} "
                        f"tts={record.get('time_to_first_step_s')} wall={record.get('wall_s')}")
                    jobs.append({"model": model, "kind": kind, "repeat": r, **record})
    return jobs


def summarize(jobs: Sequence[dict[str, Any]], models: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        by_kind: dict[str, dict[str, float | None]] = {}
        for kind in KINDS:
            runs = [parts(j) for j in jobs if j["model"] == model and j["kind"] == kind
                    and j.get("ok")]
            names = list(dict.fromkeys(n for p in runs for n in p))
            by_kind[kind] = {n: median(p.get(n) for p in runs) for n in names}
        e, n, c = (by_kind[k].get("to end of step 1") for k in KINDS)
        pe, pn = by_kind["eager"].get("process"), by_kind["new"].get("process")
        rows.append({
            "model": model, "parts": by_kind,
            "new_vs_eager_step1": benchlib.ratio(n, e) if n and e else None,
            "new_vs_eager_process": benchlib.ratio(pn, pe) if pn and pe else None,
            "overhead_removed": round((c - n) / (c - e), 3) if c and n and e and c > e
            else None,
        })
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        names = list(dict.fromkeys(n for k in KINDS for n in row["parts"][k]))
        cells = [[n, *(benchlib.fmt_num(row["parts"][k].get(n), "{:.2f}") for k in KINDS)]
                 for n in names]
        out.append(f"{row['model']} (median seconds)")
        out.append(benchlib.markdown_table(("part", *KINDS), cells))
        out.append(f"{row['model']}: new machine / eager = {row['new_vs_eager_step1']}x to end "
                   f"of step 1, {row['new_vs_eager_process']}x whole process; compile "
                   f"overhead removed {row['overhead_removed']}\n")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated from {', '.join(CORPUS)}, or all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep-temp", action="store_true")
    args = parser.parse_args(argv)
    models = list(CORPUS) if args.models == "all" else [m for m in args.models.split(",") if m]
    with benchlib.temp_root("budget_bench.", args.keep_temp) as root:
        bench = Bench(root, args.steps, args.timeout, GxxCounter(root / "bin"))
        jobs = run(bench, models, args.repeats)
    rows = summarize(jobs, models)
    benchlib.write_json(args.out, {"date": benchlib.utc_now(), "argv": argv,
                                   "machine": benchlib.machine_info(), "summary": rows,
                                   "jobs": jobs})
    print(render(rows))
    return 0 if all(j.get("ok") for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
