"""Time to first training step with and without a remote compile cache, job by job.

    python -m benchmarks compile_bench --quick
    python -m benchmarks compile_bench --models mlp,transformer,dlrm --repeats 3 --write-results

Every job is a fresh `train_job.py` process with its own Inductor/Triton cache dirs and its
own TMPDIR (Inductor keeps precompiled headers there), so each one sees what a new machine
or container would see. Scenarios (SCENARIOS below): cold, warm-local, mega-only,
torch-redis (torch's own remote caches), megacache (our server, a new machine per job) and
megacache-other-path (the same, with the consumer's torch in a venv at another path).

The key figure is megacache / warm-local (goal: <= 1.25). Repeats are interleaved
(repeat r runs every scenario) so background noise hits all scenarios alike. g++ is
wrapped to count the compiler invocations each job really pays for.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import util
from pathlib import Path
from typing import Any

from benchmarks.harness import TRAIN_JOB, benchlib
from benchmarks.harness.benchlib import log
from benchmarks.harness.benchlib import median_of_present as median
from benchmarks.harness.machines import (
    GxxCounter,
    JobRun,
    Machine,
    TritonCounter,
    nothing_loaded,
    run_job,
)
from benchmarks.harness.other_path import DEFAULT_VENV, OtherPath
from benchmarks.harness.record import make_record, write_record
from benchmarks.harness.results_md import write_section
from benchmarks.harness.servers import LocalRedis, LocalServer, redis_server_exe

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_OUT = BENCH_DIR / "results" / "compile.json"
RESULTS_MD = BENCH_DIR / "RESULTS.md"

MODELS = ("mlp", "transformer", "dlrm", "conv", "gpt2")
DEFAULT_MODELS = MODELS[:4]
"""gpt2 (transformers' GPT-2 from a config: a third-party model) only when asked for."""
# Scenario -> what a job of it is; the order is the run order within a repeat.
SCENARIOS = {
    "eager": "the same trainer without torch.compile, on a new machine: what a start would "
             "cost if compiling were free (the floor every other scenario is held to)",
    "cold": "empty caches, torch alone (it also saves its Mega-Cache bundle for mega-only)",
    "warm-local": "the cold run's cache dirs again: a job restarting on the same node, "
                  "the best case",
    "mega-only": "empty caches + torch.compiler.load_cache_artifacts of the cold run's "
                 "bundle, nothing else",
    "torch-redis": "empty caches + torch's own FX-graph and AOT-autograd remote caches on a "
                   "local redis, filled first by one untimed producer job",
    "megacache": "empty caches + an empty node cache + our server, filled first by one "
                 "untimed producer job: every timed job is a brand-new machine "
                 "(MEGACACHE_PRECOMPILE=0: Inductor and AOTAutograd artifacts only)",
    "warm-local+precompile": "torch alone with torch._dynamo.config.caching_precompile on, "
                             "on a copy of the repeat's cold node after one more untimed job "
                             "with precompile on (its save_cache_artifacts call writes "
                             "Dynamo's cache): torch's best local restart",
    "megacache+precompile": "as megacache with MEGACACHE_PRECOMPILE=1 (the default): "
                            "precompiled Dynamo output in the bundle where its producer "
                            "verified it, prefetch at enable (its own producer)",
    "warm-local+init5": "warm-local with a 5 s simulated trainer initialisation (sleep) "
                        "between `import torch` and torch.compile",
    "megacache+precompile+init5": "megacache+precompile (same producer and entry) with the "
                                  "same 5 s initialisation: prefetch runs during it",
    "megacache-other-path": "as megacache (its own server and producer), but every timed "
                            "consumer runs torch from a second venv at another path; after "
                            "each, an untimed consumer at the producer's path checks that "
                            "nothing was re-published over the entry (no thrash)",
}
OTHER_PATH = "megacache-other-path"
MEGACACHE_SCENARIOS = ("megacache", "megacache+precompile", OTHER_PATH)
"""Scenarios that run their own server and producer."""
INIT_S = 5.0
SHARED_PRODUCER = {"megacache+precompile+init5": "megacache+precompile"}
"""Scenarios whose consumers use another scenario's service and producer (same key)."""
START_GOALS = {"megacache+precompile": 1.0, "megacache+precompile+init5": 1.1}
"""Time to first step of a new machine / torch's warm-local (with the same init)."""
FIRST_STEP_GOAL_S = 0.2
NEEDS_COLD = ("cold", "warm-local", "mega-only", "warm-local+precompile",
              "warm-local+init5")  # these reuse the repeat's cold run
GOAL_VS_WARM = 1.25
EAGER_GOALS = {"megacache": 1.25}
"""Time to first step of a new machine with the client's defaults / the eager trainer's."""

# -- services the benchmark owns ---------------------------------------------------------

@contextlib.contextmanager
def redis_service(root: Path) -> Iterator[dict[str, str]]:
    """A throwaway redis on loopback; yields the env that points torch's remote caches at it."""
    redis = LocalRedis(root / "redis").start()
    try:
        # torch 2.13 remote_cache.RedisRemoteCacheBackend reads TORCHINDUCTOR_REDIS_HOST/PORT
        # (or TORCHINDUCTOR_REDIS_URL); the two caches are switched on separately.
        yield {
            "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
            "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
            "TORCHINDUCTOR_REDIS_HOST": "127.0.0.1",
            "TORCHINDUCTOR_REDIS_PORT": str(redis.port),
        }
    finally:
        redis.stop()


@contextlib.contextmanager
def megacache_service(root: Path) -> Iterator[dict[str, str]]:
    """Our server on loopback with an empty data dir; yields the env that points clients at it."""
    server = LocalServer(root / "megacache" / "data").start(timeout=180)  # busy hosts are slow
    try:
        yield {"MEGACACHE_URL": server.url}
    finally:
        server.stop()


# -- one job -----------------------------------------------------------------------------

@dataclass
class Bench:
    """What every job shares: the temp root, the g++ counter, steps and timeout."""

    root: Path
    steps: int
    timeout_s: float
    gxx: GxxCounter
    other: OtherPath | None = None
    device: str = "cpu"
    triton: TritonCounter | None = None
    """Counts Triton compilations (ptxas runs) of `--device cuda` jobs."""

    def machine(self, *parts: str) -> Machine:
        """A new machine: empty Inductor, Triton, TMPDIR and node-cache dirs."""
        return Machine(self.root.joinpath(*parts))

    def run(self, machine: Machine, env: dict[str, str], args: Sequence[str],
            other_path: bool = False) -> dict[str, Any]:
        """train_job.py on `machine` in a fresh process: its result and g++ builds, or an error.

        `other_path` runs it with the second venv's torch (OtherPath)."""
        runner = None
        if other_path:
            assert self.other is not None
            runner = [str(self.other.python), str(TRAIN_JOB)]
            env = {**env, **self.other.env()}
        # Inductor runs config.cpp.cxx = $CXX or "g++" through PATH (cpp_builder
        # .get_cpp_compiler -> cpp_compiler_search): pinning CXX to the default "g++" keeps
        # a CXX of the calling shell from bypassing the counting wrapper first on PATH.
        run = run_job(machine, "--steps", str(self.steps), "--device", self.device, *args,
                      env={**env, "CXX": "g++"}, gxx=self.gxx, timeout=self.timeout_s,
                      runner=runner, triton=self.triton)
        return job_record(run)


def job_record(run: JobRun) -> dict[str, Any]:
    """One finished job as a benchmark row: its wall, builds and result, or why it failed."""
    record: dict[str, Any] = {"wall_s": round(run.wall_s, 3), "gxx_builds": run.gxx_builds,
                              "triton_compiles": run.triton_compiles,
                              "triton_kernels": run.triton_kernels}
    if run.returncode == 0 and run.result:
        record.update(run.result, ok=True)
        if run.warnings():
            record["megacache_log"] = run.warnings()[-5:]
    else:
        tail = run.stderr.strip()
        last = tail.splitlines()[-1] if tail else "no output"
        record.update(ok=False, error=f"exit {run.returncode}: {last}",
                      output_tail=tail[-1500:])
    return record


# -- scenarios ---------------------------------------------------------------------------

@dataclass
class Remote:
    """A shared cache service and the env its producers and consumers need (or why not)."""

    env: dict[str, str] | None = None
    skipped: str | None = None


def redis_unavailable() -> str | None:
    if util.find_spec("redis") is None:
        return (f"python package 'redis' is not installed in {sys.executable}: torch's "
                "remote caches need it (pip install redis)")
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH"
    return None


def run_benchmark(bench: Bench, models: Sequence[str], scenarios: Sequence[str],
                  repeats: int) -> list[dict[str, Any]]:
    """All jobs, models in turn, scenarios interleaved within each repeat."""
    jobs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        wanted = {SHARED_PRODUCER.get(name, name) for name in scenarios}
        remotes = {name: start_remote(stack, bench.root, name)
                   for name in ("torch-redis", *MEGACACHE_SCENARIOS) if name in wanted}
        for model in models:
            produced = {name: produce(bench, model, name, remote)
                        for name, remote in remotes.items()}
            for r in range(1, repeats + 1):
                jobs += run_repeat(bench, model, scenarios, r, repeats, remotes, produced)
                shutil.rmtree(bench.root / model / f"r{r}", ignore_errors=True)
    return jobs


def start_remote(stack: contextlib.ExitStack, root: Path, name: str) -> Remote:
    """Start the service behind a remote scenario, or say why the scenario cannot run."""
    if name == "torch-redis" and (why := redis_unavailable()):
        log(f"torch-redis skipped: {why}")
        return Remote(skipped=why)
    try:
        service = redis_service(root) if name == "torch-redis" \
            else megacache_service(root / name)
        env = stack.enter_context(service)
    except (RuntimeError, OSError) as exc:
        log(f"{name} skipped: {exc}")
        return Remote(skipped=f"could not start the service: {exc}")
    log(f"{name}: service up ({', '.join(f'{k}={v}' for k, v in env.items())})")
    return Remote(env=env)


def remote_job(bench: Bench, model: str, name: str, remote: Remote, machine: Machine,
               other_path: bool = False) -> dict[str, Any]:
    """One job of a remote scenario on a new machine (producer and consumers alike)."""
    assert remote.env is not None
    mode = "explicit" if name.startswith("megacache") else "off"
    env = {**remote.env, "MEGACACHE_PRECOMPILE": "0"} if name in ("megacache", OTHER_PATH) \
        else {**remote.env, "MEGACACHE_MODEL": model,  # named, as a deployment would
              "MEGACACHE_PRECOMPILE": "1"}
    return bench.run(machine, env, ["--model", model, "--megacache", mode, *init_args(name)],
                     other_path=other_path)


def init_args(name: str) -> list[str]:
    """train_job.py flags of a scenario with a simulated trainer initialisation."""
    return ["--init-s", str(INIT_S)] if name.endswith("+init5") else []


def produce(bench: Bench, model: str, name: str, remote: Remote) -> dict[str, Any] | None:
    """Fill a remote cache with one untimed job, as the first job of a fleet would."""
    if remote.env is None:
        return None
    log(f"{model} {name}: untimed producer")
    record = remote_job(bench, model, name, remote, bench.machine(model, "producer", name))
    log(f"{model} {name}: producer {describe(record)}")
    shutil.rmtree(bench.root / model / "producer" / name, ignore_errors=True)
    return record


def run_repeat(bench: Bench, model: str, scenarios: Sequence[str], r: int, repeats: int,
               remotes: dict[str, Remote], produced: dict[str, dict[str, Any] | None]
               ) -> list[dict[str, Any]]:
    """Repeat r of every selected scenario, in the fixed order of SCENARIOS."""
    jobs: list[dict[str, Any]] = []
    cold_box = bench.machine(model, f"r{r}", "cold")
    for name in SCENARIOS:
        if name not in scenarios and not (name == "cold" and set(NEEDS_COLD) & set(scenarios)):
            continue
        log(f"{model} {name} r{r}/{repeats}")
        group = SHARED_PRODUCER.get(name, name)
        if group in remotes:
            record = remote_repeat(bench, model, name, remotes[group], r, produced.get(group))
        else:
            record = local_job(bench, model, name, r, cold_box)
        log(f"{model} {name} r{r}/{repeats}: {describe(record)}")
        if name in scenarios:
            jobs.append({"model": model, "scenario": name, "repeat": r, **record})
    return jobs


def local_job(bench: Bench, model: str, name: str, r: int, cold_box: Machine
              ) -> dict[str, Any]:
    """cold, warm-local or mega-only: torch alone, around the repeat's cold machine."""
    bundle = cold_box.root / "megacache.bin"
    args = ["--model", model, "--megacache", "off"]
    if name == "eager":
        return bench.run(bench.machine(model, f"r{r}", name), {}, [*args, "--eager"])
    if name == "cold":
        record = bench.run(cold_box, {}, [*args, "--save-bundle", str(bundle)])
        record["bundle_bytes"] = bundle.stat().st_size if bundle.exists() else 0
        return record
    if name in ("warm-local", "warm-local+init5"):
        return bench.run(cold_box, {}, [*args, *init_args(name)])
    if name == "warm-local+precompile":
        box = precompile_box(bench, model, r, cold_box)
        if box is None:
            return {"ok": False, "error": "the untimed cold job with precompile failed"}
        return bench.run(box, {}, [*args, "--precompile"])
    if not bundle.exists():
        return {"ok": False, "error": "no bundle: the cold run of this repeat failed"}
    return bench.run(bench.machine(model, f"r{r}", name), {},
                     [*args, "--load-bundle", str(bundle)])


def precompile_box(bench: Bench, model: str, r: int, cold_box: Machine) -> Machine | None:
    """The repeat's cold node after one more untimed job, this one with precompile on.

    A copy of the cold node (kernels, headers, FX graphs: no g++ run again) on which a job
    with caching precompile on called save_cache_artifacts, which writes Dynamo's cache:
    a node that has run the job before with precompile on.
    """
    box = bench.machine(model, f"r{r}", "precompile-box")
    if not (cold_box.root / "megacache.bin").exists():
        return None  # the cold run failed
    shutil.copytree(cold_box.root, box.root, dirs_exist_ok=True, symlinks=True)
    log(f"{model} warm-local+precompile r{r}: untimed job with precompile on the cold node")
    record = bench.run(box, {}, ["--model", model, "--megacache", "off", "--precompile",
                                 "--save-bundle", str(box.root / "precompile.bin")])
    if not record.get("ok"):
        log(f"{model} precompile box: {describe(record)}")
        return None
    return box


def remote_repeat(bench: Bench, model: str, name: str, remote: Remote, r: int,
                  producer: dict[str, Any] | None) -> dict[str, Any]:
    """A timed consumer of torch-redis or megacache on a new machine, or why it was skipped."""
    if remote.env is None:
        return {"ok": False, "skipped": remote.skipped}
    record = remote_job(bench, model, name, remote, bench.machine(model, f"r{r}", name),
                        other_path=name == OTHER_PATH)
    record["producer"] = summarize_producer(producer)
    if name == OTHER_PATH:
        after = remote_job(bench, model, name, remote,
                           bench.machine(model, f"r{r}", name + "-then-original"))
        record["then_original_path"] = summarize_producer(after)
        log(f"{model} {name} r{r}: then a consumer at the original path: {describe(after)}")
    return record


def summarize_producer(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    keep = ("ok", "error", "time_to_first_step_s", "counters", "gxx_builds", "megacache")
    return {k: record[k] for k in keep if k in record}


def describe(record: dict[str, Any]) -> str:
    if record.get("skipped"):
        return f"skipped ({record['skipped']})"
    if not record.get("ok"):
        return f"FAILED: {str(record.get('error', '?'))[-300:]}"
    c = record["counters"]
    mega = record.get("megacache") or {}
    extra = f", megacache {mega.get('outcome')} {mb(mega.get('bytes_down'))} MB down" \
        if mega else ""
    return (f"first step at {record['time_to_first_step_s']:.2f}s (compile "
            f"{record['compile_s']:.2f}s, fx {c['fxgraph_hit']}/{c['fxgraph_miss']}, "
            f"g++ builds {record['gxx_builds']}{extra})")


# -- summary -----------------------------------------------------------------------------

def mb(n: Any) -> float:
    return round((n or 0) / 1e6, 2)


def summarize(jobs: Sequence[dict[str, Any]], models: Sequence[str],
              scenarios: Sequence[str]) -> list[dict[str, Any]]:
    """Median and range per model and scenario, with the ratios against the baselines."""
    rows: list[dict[str, Any]] = []
    for model in models:
        model_rows = [summarize_one(model, name, [j for j in jobs if j["model"] == model
                                                  and j["scenario"] == name])
                      for name in SCENARIOS if name in scenarios]
        medians = {row["scenario"]: row["ttfs_median_s"] for row in model_rows}
        for row in model_rows:
            nothing = bool(row["ok"]) and len(row["missed"]) == row["ok"]
            for base in ("warm-local", "cold", "eager"):
                if nothing:  # no ratio: it would read as a speed-up the cache did not give
                    row[f"vs_{base}"] = None
                    continue
                same_init = base + "+init5" if row["scenario"].endswith("+init5") else base
                b = medians.get(same_init) if base == "eager" else \
                    medians.get(same_init) or medians.get(base)
                v = row["ttfs_median_s"]
                row[f"vs_{base}"] = round(v / b, 2) if v is not None and b else None
        rows += model_rows
    return rows


def missed(name: str, job: dict[str, Any]) -> str:
    """Why a job of a scenario that should start warm loaded nothing ("" when it did, and
    for the cold and eager baselines, which load nothing by design)."""
    if name in ("cold", "eager"):
        return ""
    if name.startswith("megacache"):
        return nothing_loaded(job)
    c = job.get("counters") or {}
    if c.get("fxgraph_hit", 0) + c.get("aot_hit", 0) + (job.get("precompile_hit") or 0):
        return ""
    return "torch's caches served none of its graphs (FX graph, AOTAutograd and Dynamo " \
        "hits all 0)"


def summarize_one(model: str, name: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [j for j in runs if j.get("ok")]
    ttfs = [j["time_to_first_step_s"] for j in ok]
    return {
        "model": model, "scenario": name, "runs": len(runs), "ok": len(ok),
        "missed": [why for j in ok if (why := missed(name, j))],
        "errors": [j.get("error") or j.get("skipped") for j in runs if not j.get("ok")],
        "ttfs_median_s": median(ttfs),
        "ttfs_min_s": min(ttfs) if ttfs else None,
        "ttfs_max_s": max(ttfs) if ttfs else None,
        "first_step_s": median([j["first_step_s"] for j in ok]),
        "steady_step_s": median([j["steady_step_s"] for j in ok]),
        "compile_s": median([j["compile_s"] for j in ok]),
        "counters": {k: median([j["counters"][k] for j in ok])
                     for k in ("fxgraph_hit", "fxgraph_miss", "aot_hit", "aot_miss")},
        "gxx_builds": median([j["gxx_builds"] for j in ok]),
        "triton_compiles": median([j.get("triton_compiles") for j in ok]),
        "triton_kernels": median([j.get("triton_kernels") for j in ok]),
        "mb_down": median([mb(j["megacache"].get("bytes_down")) for j in ok
                           if j.get("megacache")]),
        "outcomes": sorted({j["megacache"].get("outcome") for j in ok if j.get("megacache")}),
        "then_original_gxx": [(j.get("then_original_path") or {}).get("gxx_builds")
                              for j in ok if "then_original_path" in j] or None,
        "republished": [bool((j.get("megacache") or {}).get("published"))
                        for j in ok if j.get("megacache")] or None,
        "tts_split": {k: median([j["megacache"]["tts"].get(f"tts_{k}_s") for j in ok
                                 if j.get("megacache", {}).get("tts")])
                      for k in ("import", "fetch", "load", "compile", "rest")},
        "precompile_hit": median([j.get("precompile_hit") for j in ok]),
    }


HEADER = ("model", "scenario", "ttfs med s", "min-max s", "1st step s", "compile s",
          "fx hit/miss", "aot hit/miss", "g++ builds", "triton compiles", "MB down",
          "x eager", "x warm", "x cold")


def no_load(_: float | None) -> str:
    """The ratio cell of a row whose runs all loaded nothing: a ratio would read as a
    speed-up the cache did not give."""
    return "no load"


def table_cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    def num(v: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    def pair(a: float | None, b: float | None) -> str:
        return "-" if a is None else f"{a:g}/{b:g}"

    cells = []
    for r in rows:
        if not r["ok"]:
            reason = (r["errors"] or ["?"])[0] or "?"
            cells.append([r["model"], r["scenario"], "n/a", reason.splitlines()[0][:100]]
                         + [""] * (len(HEADER) - 4))
            continue
        c = r["counters"]
        ratio = no_load if r["missed"] and len(r["missed"]) == r["ok"] else num
        spread = f"{r['ttfs_min_s']:.2f}-{r['ttfs_max_s']:.2f}"
        if r["ok"] < r["runs"]:
            spread += f" ({r['runs'] - r['ok']} failed)"
        cells.append([
            r["model"], r["scenario"], num(r["ttfs_median_s"]), spread,
            num(r["first_step_s"]), num(r["compile_s"]),
            pair(c["fxgraph_hit"], c["fxgraph_miss"]), pair(c["aot_hit"], c["aot_miss"]),
            num(r["gxx_builds"], "{:g}"), num(r.get("triton_compiles"), "{:g}"),
            num(r["mb_down"]), ratio(r.get("vs_eager")),
            ratio(r.get("vs_warm-local")), ratio(r.get("vs_cold")),
        ])
    return cells


def render_text(rows: Sequence[dict[str, Any]]) -> str:
    return benchlib.text_table(HEADER, table_cells(rows))


def render_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return benchlib.markdown_table(HEADER, table_cells(rows))


def over_goal(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["scenario"] in MEGACACHE_SCENARIOS and r.get("vs_warm-local")
            and r["vs_warm-local"] > GOAL_VS_WARM]


def missed_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per row some of whose runs loaded nothing: how many, and why."""
    lines = []
    for r in rows:
        if r.get("missed"):
            reasons = "; ".join(sorted(set(r["missed"])))[:400]
            lines.append(f"{r['model']} {r['scenario']}: {len(r['missed'])} of {r['ok']} "
                         f"runs loaded nothing, no speed-up claimed for them ({reasons})")
    return lines


def start_goals(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per model and time-to-start goal: met or missed, with the figure (a row
    whose runs all loaded nothing has no figure: the goal is missed)."""
    lines = []
    for r in rows:
        if r.get("missed") and len(r["missed"]) == r["ok"] and (
                r["scenario"] in EAGER_GOALS or r["scenario"] in START_GOALS):
            lines.append(f"{r['model']} {r['scenario']}: MISSED, nothing loaded")
            continue
        eager_goal = EAGER_GOALS.get(r["scenario"])
        if eager_goal is not None and r.get("vs_eager") is not None:
            ok = r["vs_eager"] <= eager_goal and (r.get("vs_warm-local") or 0) <= 1.0
            lines.append(f"{r['model']} {r['scenario']}: {r['vs_eager']:.2f}x eager (goal <= "
                         f"{eager_goal}), {r.get('vs_warm-local') or 0:.2f}x warm-local (goal "
                         f"<= 1.0) {'met' if ok else 'MISSED'}")
        goal = START_GOALS.get(r["scenario"])
        if goal is None or r.get("vs_warm-local") is None:
            continue
        base = "warm-local+init5" if r["scenario"].endswith("+init5") else "warm-local"
        ok = r["vs_warm-local"] <= goal
        line = (f"{r['model']} {r['scenario']}: {r['vs_warm-local']:.2f}x {base} "
                f"(goal <= {goal}) {'met' if ok else 'MISSED'}")
        if r["scenario"] == "megacache+precompile" and r["first_step_s"] is not None:
            step_ok = r["first_step_s"] <= FIRST_STEP_GOAL_S
            line += (f"; first step {r['first_step_s']:.2f}s (goal <= {FIRST_STEP_GOAL_S}) "
                     f"{'met' if step_ok else 'MISSED'}")
        lines.append(line)
    return lines


def render_split(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of the client-reported time-to-start split (megacache rows only)."""
    parts = ("import", "fetch", "load", "compile", "rest")
    lines = ["| model | scenario | " + " | ".join(f"{p} s" for p in parts) + " |",
             "|" + "---|" * (len(parts) + 2)]
    for r in rows:
        split = r.get("tts_split") or {}
        if any(split.get(p) is not None for p in parts):
            lines.append(f"| {r['model']} | {r['scenario']} | " + " | ".join(
                "-" if split.get(p) is None else f"{split[p]:.2f}" for p in parts) + " |")
    return "\n".join(lines)


# -- outputs -----------------------------------------------------------------------------

def compile_machine_info() -> dict[str, Any]:
    """What the numbers depend on: the machine, torch, g++ and the Redis reference."""
    return benchlib.machine_info(
        packages={"torch": "torch", "redis_py": "redis"},
        tools={"gxx": ("g++", "--version"),
               "redis_server": (redis_server_exe() or "redis-server", "--version")})


def write_chart(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Grouped bars of median time-to-first-step; skipped (False) without matplotlib."""
    plt = benchlib.pyplot()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = list(dict.fromkeys(r["scenario"] for r in rows))
    series: dict[str, list[float]] = {}
    errors: dict[str, list[list[float]]] = {}
    for name in names:
        by_model = {r["model"]: r for r in rows if r["scenario"] == name}
        med = [by_model[m]["ttfs_median_s"] or 0.0 for m in models]
        series[name] = med
        pairs = list(zip(models, med, strict=True))
        errors[name] = [[mid - (by_model[m]["ttfs_min_s"] or 0) for m, mid in pairs],
                        [(by_model[m]["ttfs_max_s"] or 0) - mid for m, mid in pairs]]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(models)), 4.5))
    benchlib.grouped_bars(ax, models, series, errors, tick_fontsize=None)
    ax.set_ylabel("time to first step, s (median, min-max)")
    ax.set_title("torch.compile: time to first training step on a new job")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    benchlib.save_figure(plt, fig, path, dpi=120)
    return True


def thrash_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The no-thrash check of megacache-other-path, one line per model."""
    return [f"- {r['model']}: other-path consumers re-published {r['republished']}; "
            f"then consumers at the original path paid g++ builds {r['then_original_gxx']}"
            for r in rows if r["scenario"] == OTHER_PATH and r.get("then_original_gxx")]


SECTION_TITLES = {"compile": "Compile benchmark results",
                  "compile-eager": "Time to start against eager (compile benchmark)"}
"""RESULTS.md sections this script writes whose title is not the time-to-start one."""


def write_results_md(report: dict[str, Any], chart: Path | None,
                     section: str = "compile") -> None:
    """Regenerate one section of RESULTS.md from one run (other sections stay)."""
    m, rows = report["machine"], report["rows"]
    title = SECTION_TITLES.get(section, "Time to start: precompiled Dynamo and prefetch "
                                        "(compile benchmark)")
    lines = [
        f"# {title}",
        "",
        *benchlib.generated_by("compile_bench.py", report["argv"]),
        f"- date: {report['date']}",
        benchlib.machine_line(m),
        f"- torch {m['torch']}, Python {m['python']}, {m['gxx']}, "
        f"redis-py {m['redis_py']}, {m['redis_server'] or 'no redis-server'}",
        f"- commit {m['git_commit']}; {report['repeats']} repeats of {report['steps']} "
        "training steps, each job a fresh process with fresh cache dirs",
        *([f"- device {report.get('device')}: {report['gpu']['name']} (compute capability "
           f"{report['gpu']['major']}.{report['gpu']['minor']})"] if report.get("gpu") else []),
        "",
        "`ttfs` is the time from process start to the end of the first training step "
        "(imports included). Medians over repeats; `x eager` / `x warm` / `x cold` divide the "
        "median by the eager / warm-local / cold median (eager: the trainer without "
        f"torch.compile, the floor). Goals: every megacache scenario <= {GOAL_VS_WARM} x "
        "warm-local; with the client's defaults, also <= "
        f"{EAGER_GOALS['megacache']} x eager and <= 1.0 x warm-local (listed below the table).",
        "",
        render_markdown(rows),
        "",
    ]
    if nothing := missed_lines(rows):
        lines += ["Loaded nothing (`no load`: no ratio shown):", ""] + \
            [f"- {n}" for n in nothing] + [""]
    goals = start_goals(rows)
    if goals:
        lines += ["Time-to-start goals:", ""] + [f"- {g}" for g in goals] + [""]
        lines += ["Split of the megacache jobs' time to start as the client reports it in "
                  "its event (`tts_*_s`, medians; see docs/how-it-works.md, Time to start):", "",
                  render_split(rows), ""]
    if chart is not None:
        lines += [benchlib.image_link("time to first step", chart), ""]
    misses = over_goal(rows)
    if misses:
        lines += ["Over the goal: " + ", ".join(
            f"{r['model']} {r['scenario']} ({r['vs_warm-local']:.2f}x warm-local)"
            for r in misses), ""]
    if thrash := thrash_lines(rows):
        lines += ["No thrash (megacache-other-path):", "", *thrash, ""]
    lines += ["## Scenarios", ""]
    lines += [f"- `{name}`: {what}" for name, what in SCENARIOS.items()]
    lines += ["", "Every job runs with a `g++` wrapper first on PATH; `g++ builds` counts the "
              "calls that wrote a kernel `.so` or a precompiled header (version queries and "
              "Inductor's `-E` pass over its header, which keys the `.gch`, excluded; `gcc`'s "
              "too: Triton's launchers on a GPU). `triton compiles` (`--device cuda`) counts "
              "ptxas runs: Triton kernels compiled, not restored from a bundle.", ""]
    write_section(section, "\n".join(lines), RESULTS_MD)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: train on GPU 0; every machine has its own empty Triton "
                             "cache dir, Triton compilations are counted (ptxas runs)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, from {', '.join(SCENARIOS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps per job")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: mlp, cold+megacache, 1 repeat, 2 steps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="JSON results (the chart goes next to it as .png)")
    parser.add_argument("--write-results", action="store_true",
                        help=f"regenerate {RESULTS_MD.relative_to(REPO)}")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--keep-temp", action="store_true", help="keep the temp root")
    parser.add_argument("--other-venv", type=Path, default=DEFAULT_VENV,
                        help=f"the second venv of {OTHER_PATH} (created once, then kept)")
    parser.add_argument("--section", "--results-section", dest="section", default="compile",
                        help="the RESULTS.md section to write (a partial run can keep its own; "
                             "time-to-start runs use time-to-start-<model>)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.scenarios, args.repeats, args.steps = "mlp", "cold,megacache", 1, 2
    args.models = [m for m in args.models.split(",") if m]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    for kind, chosen, known in (("model", args.models, MODELS),
                                ("scenario", args.scenarios, SCENARIOS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"unknown {kind}(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(known)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    with benchlib.temp_root("compile_bench.", args.keep_temp) as root:
        log(f"temp root {root}; models {','.join(args.models)}; scenarios "
            f"{','.join(args.scenarios)}; {args.repeats} repeats of {args.steps} steps")
        other = OtherPath(args.other_venv).ensure(log) if OTHER_PATH in args.scenarios \
            else None
        triton = TritonCounter(root / "bin") if args.device == "cuda" else None
        if triton is not None and not triton.available:
            log("no ptxas of Triton's found: Triton compilations are not counted")
        bench = Bench(root, args.steps, args.timeout, GxxCounter(root / "bin"), other,
                      args.device, triton)
        jobs = run_benchmark(bench, args.models, args.scenarios, args.repeats)
    rows = summarize(jobs, args.models, args.scenarios)
    report = make_record(
        "compile_bench", argv, rows, goals=start_goals(rows), machine=compile_machine_info(),
        repeats=args.repeats, steps=args.steps, jobs=jobs, device=args.device,
        gpu=next((j["gpu"] for j in jobs if j.get("gpu")), None))
    write_record(report, args.out)
    chart = args.out.with_suffix(".png")
    have_chart = write_chart(rows, chart)
    print(render_text(rows))
    for line in missed_lines(rows) + start_goals(rows):
        print(line)
    for r in over_goal(rows):
        print(f"note: {r['model']} {r['scenario']} is {r['vs_warm-local']:.2f}x warm-local "
              f"(goal <= {GOAL_VS_WARM})")
    print("\n".join(thrash_lines(rows)))
    if args.write_results:
        write_results_md(report, chart if have_chart else None, args.section)
    log(f"wrote {args.out}" + (f", {chart}" if have_chart else "")
        + (f", {RESULTS_MD}" if args.write_results else ""))
    return 0 if all(j.get("ok") or j.get("skipped") for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
