"""The budget of a new machine: process start -> end of step 1, part by part, against eager.

    python -m benchmarks budget_bench [--models mlp,transformer | all] [--repeats 3]
    python -m benchmarks budget_bench --hf [--models gpt2,llama | all] [--repeats 2]

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

`--hf` runs the third-party corpus of the suite instead (benchmarks/harness/corpus_job.py: six
Hugging Face `transformers` architectures from tiny configs, the unmodified script, `torch.compile
(model)`), zero-code as its users run it: the new machine gets only `MEGACACHE_URL` and
`MEGACACHE_MODEL`, the autoload hook does the rest. Its parts are the script's marks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.compile_bench import Bench, job_record, local_job, megacache_service
from benchmarks.harness import CORPUS_JOB, benchlib
from benchmarks.harness.benchlib import log
from benchmarks.harness.benchlib import median_of_present as median
from benchmarks.harness.machines import GxxCounter, run_job
from benchmarks.harness.record import make_record, write_record

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "budget.json"
DEFAULT_HF_OUT = BENCH_DIR / "results" / "budget_hf.json"
CORPUS = ("mlp", "transformer", "dlrm", "conv", "gpt2")
DEFAULT_MODELS = ("mlp", "transformer")
KINDS = ("eager", "new", "cold")
HF_JOB = CORPUS_JOB
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

OneJob = Callable[[Bench, str, str, str, dict[str, str]], dict[str, Any]]
"""(bench, model, kind, where, the server's env) -> the job's record."""


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
        # a zero-code script (--hf) has no client call: its build follows the imports
        "build model": _gap(marks, "built_s", "initialised_s" if "initialised_s" in marks
                            else "torch_imported_s"),
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


def bench_job(bench: Bench, model: str, kind: str, where: str, server: dict[str, str]
              ) -> dict[str, Any]:
    """One of benchmarks/harness/models.py's models in train_job.py."""
    if kind == "new":
        return new_machine(bench, model, server, where)
    return local_job(bench, model, kind, int(where[1:]), bench.machine(model, where, "cold"))


def hf_job(bench: Bench, model: str, kind: str, where: str, server: dict[str, str]
           ) -> dict[str, Any]:
    """One corpus model in the unmodified benchmarks/harness/corpus_job.py; megacache only
    through env."""
    env = {**server, "MEGACACHE_MODEL": f"corpus-{model}"} if kind == "new" else {}
    run = run_job(bench.machine("hf", model, where, kind), str(HF_JOB), model,
                  str(bench.steps), *(["--eager"] if kind == "eager" else []),
                  env={**env, **OFFLINE, "CXX": "g++"}, gxx=bench.gxx,
                  runner=[sys.executable], timeout=bench.timeout_s)
    return job_record(run)


def run(bench: Bench, models: Sequence[str], repeats: int, one_job: OneJob = bench_job
        ) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    with megacache_service(bench.root / "server") as env:
        for model in models:
            log(f"{model}: untimed producer")
            produced = one_job(bench, model, "new", "producer", env)
            log(f"{model}: producer ok={produced.get('ok')} {produced.get('error') or ''}")
            for r in range(1, repeats + 1):
                for kind in KINDS:
                    record = one_job(bench, model, kind, f"r{r}", env)
                    log(f"{model} {kind} r{r}: ok={record.get('ok')} "
                        f"tts={record.get('time_to_first_step_s')} wall={record.get('wall_s')} "
                        f"g++={record.get('gxx_builds')} {record.get('error') or ''}")
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
            "new_gxx_builds": max((j.get("gxx_builds") or 0 for j in jobs
                                   if j["model"] == model and j["kind"] == "new"), default=None),
        })
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        names = [n for n in dict.fromkeys(n for k in KINDS for n in row["parts"][k])
                 if any(row["parts"][k].get(n) is not None for k in KINDS)]
        cells = [[n, *(benchlib.fmt_num(row["parts"][k].get(n), "{:.2f}") for k in KINDS)]
                 for n in names]
        out.append(f"{row['model']} (median seconds)")
        out.append(benchlib.markdown_table(("part", *KINDS), cells))
        out.append(f"{row['model']}: new machine / eager = {row['new_vs_eager_step1']}x to end "
                   f"of step 1, {row['new_vs_eager_process']}x whole process; compile "
                   f"overhead removed {row['overhead_removed']}; g++ builds on a new machine "
                   f"{row['new_gxx_builds']}\n")
    return "\n".join(out)


def hf_corpus() -> tuple[str, ...]:
    """The names of benchmarks/harness/corpus_job.py's CORPUS (its one list; importing it
    imports torch)."""
    from benchmarks.harness.corpus_job import CORPUS as HF_CORPUS

    return tuple(HF_CORPUS)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated from {', '.join(CORPUS)} (with "
                        "--hf: from harness/corpus_job.py's CORPUS), or all; default: "
                        f"{','.join(DEFAULT_MODELS)} (with --hf: all)")
    parser.add_argument("--hf", action="store_true",
                        help="the third-party corpus (harness/corpus_job.py), zero-code")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path,
                        help=f"JSON (default {DEFAULT_OUT.name}; with --hf {DEFAULT_HF_OUT.name})")
    parser.add_argument("--keep-temp", action="store_true")
    args = parser.parse_args(argv)
    corpus = hf_corpus() if args.hf else CORPUS
    chosen = args.models or ("all" if args.hf else ",".join(DEFAULT_MODELS))
    models = list(corpus) if chosen == "all" else [m for m in chosen.split(",") if m]
    unknown = [m for m in models if m not in corpus]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(corpus)}")
    with benchlib.temp_root("budget_bench.", args.keep_temp) as root:
        bench = Bench(root, args.steps, args.timeout, GxxCounter(root / "bin"))
        jobs = run(bench, models, args.repeats, hf_job if args.hf else bench_job)
    rows = summarize(jobs, models)
    out = args.out or (DEFAULT_HF_OUT if args.hf else DEFAULT_OUT)
    write_record(make_record("budget_bench", argv, rows, jobs=jobs), out)
    print(render(rows))
    return 0 if all(j.get("ok") for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
