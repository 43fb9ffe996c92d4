"""The main job: a cold start, then a new machine that starts warm from megacache.

    python -m benchmarks demo [--model mlp|transformer|dlrm|conv|gpt2] [--device cuda]

Starts the embedded server (local disk + SQLite) on a free loopback port, runs a small
training job on "machine A" with empty caches (it compiles cold and publishes), then the
same job on "machine B" — fresh Inductor cache dir, fresh TMPDIR, fresh node cache, as a
new host or container would have — and prints what the cache saved. `--device cuda` trains
on GPU 0, each machine with its own empty Triton cache dir, and counts Triton compilations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.machines import (  # noqa: E402
    GxxCounter,
    JobRun,
    Machine,
    TritonCounter,
    compiled_anew,
    nothing_loaded,
    run_job,
)
from benchmarks.harness.servers import LocalServer  # noqa: E402


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp",
                        choices=("mlp", "transformer", "dlrm", "conv", "gpt2"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: train on GPU 0 (fresh Triton cache dir per machine)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="keep server data and machines here")
    parser.add_argument("--json", type=Path, help="also write both runs and the verdict here")
    parser.add_argument("--warm-from", choices=("same", "empty"), default="same",
                        help="empty: machine B asks a second, empty server (what the report "
                             "says when the new machine loads nothing)")
    args = parser.parse_args(argv)

    root = args.keep or Path(tempfile.mkdtemp(prefix="megacache-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    gxx = GxxCounter(root / "bin")
    triton = TritonCounter(root / "bin") if args.device == "cuda" else None
    job = ["--model", args.model, "--steps", str(args.steps), "--megacache", "explicit",
           "--name", f"demo-{args.model}", "--code", "demo", "--device", args.device]
    with LocalServer(root / "server-data") as server:
        say(f"server up at {server.url} (data in {root / 'server-data'})")
        env = {"MEGACACHE_URL": server.url}
        say(f"machine A: training {args.model} with empty caches (cold compile, "
            "then publish)...")
        cold = run_job(Machine(root / "machine-a"), *job, env=env, gxx=gxx, triton=triton)
        check(cold, "machine A")
        say(f"machine A: first step after {cold.result['time_to_first_step_s']:.1f}s; "
            f"{cold.mc['publish_reason']} ({cold.mc['bytes_up'] / 1e6:.1f} MB)")
        say("machine B: same job on a new machine (fresh cache dirs, fresh TMPDIR)...")
        with contextlib.ExitStack() as stack:
            if args.warm_from == "empty":
                empty = stack.enter_context(LocalServer(root / "empty-server-data"))
                env = {"MEGACACHE_URL": empty.url}
                say(f"machine B asks an empty server at {empty.url}")
            warm = run_job(Machine(root / "machine-b"), *job, env=env, gxx=gxx,
                           triton=triton)
        check(warm, "machine B")
    report(cold, warm)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": args.model, "device": args.device, "steps": args.steps,
            "cold": {**cold.result, "gxx_builds": cold.gxx_builds,
                     "triton_compiles": cold.triton_compiles},
            "new_machine": {**warm.result, "gxx_builds": warm.gxx_builds,
                            "triton_compiles": warm.triton_compiles},
            "nothing_loaded": nothing_loaded(warm.result), "verdict": verdict(cold, warm),
        }, indent=1))
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def check(run: JobRun, name: str) -> None:
    if run.returncode != 0 or not run.result:
        say(f"{name} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        raise SystemExit(1)


def report(cold: JobRun, warm: JobRun) -> None:
    rows = [("", "machine A (cold)", "machine B (new machine, megacache)")]
    for label, key, fmt in (("time to first step", "time_to_first_step_s", "{:.2f} s"),
                            ("first step", "first_step_s", "{:.2f} s"),
                            ("torch compile time", "compile_s", "{:.2f} s")):
        rows.append((label, fmt.format(cold.result[key]), fmt.format(warm.result[key])))
    c, w = cold.result["counters"], warm.result["counters"]
    rows.append(("FX graph cache hit/miss", f"{c['fxgraph_hit']}/{c['fxgraph_miss']}",
                 f"{w['fxgraph_hit']}/{w['fxgraph_miss']}"))
    rows.append(("precompiled Dynamo hits", str(cold.result.get("precompile_hit", 0)),
                 str(warm.result.get("precompile_hit", 0))))
    rows.append(("g++ builds", str(cold.gxx_builds), str(warm.gxx_builds)))
    if cold.result.get("device") == "cuda":
        rows.append(("Triton compilations", str(cold.triton_compiles),
                     str(warm.triton_compiles)))
        rows.append(("Triton kernels in cache", str(cold.triton_kernels),
                     str(warm.triton_kernels)))
    rows.append(("megacache", cold.mc["outcome"], warm.mc["outcome"]))
    rows.append(("MB moved", f"{cold.mc['bytes_up'] / 1e6:.1f} up",
                 f"{warm.mc['bytes_down'] / 1e6:.1f} down"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    gpu = cold.result.get("gpu")
    print()
    if gpu:
        print(f"GPU: {gpu['name']} (compute capability {gpu['major']}.{gpu['minor']})")
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print()
    if warm.result.get("precompile_hit") and w["fxgraph_hit"] + w["fxgraph_miss"] == 0:
        print("Machine B's FX graph cache saw no lookup (0/0): its precompiled Dynamo hits "
              "installed the compiled graphs whole, so Dynamo traced nothing and Inductor "
              "was never asked.")
    print(verdict(cold, warm))


def verdict(cold: JobRun, warm: JobRun) -> str:
    """What the cache did for machine B, claimed only from what it loaded and torch used."""
    a, b = cold.result["time_to_first_step_s"], warm.result["time_to_first_step_s"]
    why = nothing_loaded(warm.result)
    if why:
        return (f"No speed-up from megacache: machine B loaded nothing torch used ({why}). "
                f"It compiled cold ({compiled_anew(warm.result)}, {warm.gxx_builds} g++ "
                f"builds); its first step at {b:.1f} s against machine A's {a:.1f} s is not "
                "the cache's doing.")
    c = warm.result["counters"]
    partial = "" if c["fxgraph_miss"] + c["aot_miss"] == 0 else (
        f" Partly: torch still compiled what the bundle lacked ({compiled_anew(warm.result)}).")
    return (f"Compile time saved on the new machine: {warm.mc['saved_s']:.1f} s of torch "
            f"compile; first step {a - b:.1f} s sooner ({a / max(b, 1e-9):.1f}x faster "
            f"start).{partial}")


if __name__ == "__main__":
    sys.exit(main())
