"""Time to recover: a job killed at random points and resumed, three ways, side by side.

The same job (a compiled model trained for a fixed number of steps, a blocking
`torch.save` checkpoint every `--ckpt-every` steps) is killed with SIGKILL `--kills` times,
each time after a random stretch of training (one seeded schedule, the same for every way),
and restarted at once from its last checkpoint, until it finishes:

- `cold`: no megacache, each attempt on a new machine (fresh Inductor cache and TMPDIR):
  every restart compiles again;
- `megacache`: each attempt on a new machine, the client zero-code with a job id (default
  settings): a restart loads what an earlier attempt published (after its first steps;
  a killed attempt runs no exit handler);
- `warm-local`: no megacache, every attempt on the same machine: torch's own warm cache
  (the peer: what a restart in place gets).

Each attempt writes its own clock (process start, first step, saves, the kill, the end);
from it: time to recover per restart (the kill to the next attempt's first step), g++
builds per restart, ETT% (training over wall; training lost since the last checkpoint is
not training) and wall. For `megacache` the server's ETT of the job (`GET
/v1/jobs/{job}/ett`) stands beside the job's own clock, figure by figure.

Results: tables on stdout, JSON (`--out`, default benchmarks/results/recovery.json).

    python -m benchmarks recovery_bench                 # mlp, 3 kills, 3 repeats
    python -m benchmarks recovery_bench --quick         # 1 kill, 1 repeat: the script works
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.time()

BENCH = Path(__file__).resolve().parent
WAYS = ("cold", "megacache", "warm-local")


# -- the trainer (this file, run with --trainer) ----------------------------------------------
def trainer() -> None:
    """One attempt: resume from the last checkpoint, train, save every CKPT_EVERY steps;
    SIGKILL itself KILL_AFTER_S seconds after its first step (if set)."""
    truth = Path(os.environ["TRUTH"])

    def fact(name: str, **fields: Any) -> None:
        with open(truth, "a") as f:
            f.write(json.dumps({"fact": name, "at": time.time(), **fields}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    fact("started", at0=STARTED)
    import torch  # the client (zero-code) enables itself right after this import

    from benchmarks.harness.models import build

    try:
        from megacache_client import checkpoint_saved
    except ImportError:  # a trainer without megacache
        def checkpoint_saved(blocking_s: float, background_s: float | None = None,
                             step: int | None = None) -> None:
            return None

    steps, every = int(os.environ["STEPS"]), int(os.environ["CKPT_EVERY"])
    step_s, kill_after = float(os.environ["STEP_S"]), float(os.environ["KILL_AFTER_S"])
    ckpt = Path(os.environ["CKPT"])
    model, make_batch, loss_fn = build(os.environ["MODEL"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    if ckpt.exists():
        began = time.monotonic()
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        done = state["step"]
        fact("load", blocking_s=time.monotonic() - began, step=done)
    compiled = torch.compile(model)
    first = None
    for step in range(done + 1, steps + 1):
        inputs, target = make_batch(0)
        loss_fn(compiled(*inputs), target).backward()
        opt.step()
        opt.zero_grad()
        if first is None:
            first = time.monotonic()
            fact("first_step", step=step)
        time.sleep(step_s)
        if kill_after >= 0 and time.monotonic() - first >= kill_after:
            fact("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % every == 0:
            began = time.monotonic()
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       tmp)
            os.replace(tmp, ckpt)
            blocking = time.monotonic() - began
            fact("save", blocking_s=blocking, step=step)
            checkpoint_saved(blocking, step=step)
    fact("end", step=steps)


if __name__ == "__main__" and "--trainer" in sys.argv:
    trainer()
    sys.exit(0)

# -- the driver ---------------------------------------------------------------------------------
import httpx  # noqa: E402

from benchmarks.harness.benchlib import (  # noqa: E402
    BENCH_DIR,
    fmt_num,
    log,
    median,
    text_table,
)
from benchmarks.harness.machines import GxxCounter, Machine, clean_env  # noqa: E402
from benchmarks.harness.record import given_argv, make_record, write_record  # noqa: E402
from benchmarks.harness.servers import LocalServer  # noqa: E402


def read_truth(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_job(way: str, schedule: list[float], root: Path, args: argparse.Namespace,
            server: LocalServer | None, gxx: GxxCounter) -> dict[str, Any]:
    """Run the job the given way through its kills; its own clock, per attempt."""
    job = f"recovery-{way}-{root.name}"
    ckpt = root / "ckpt.pt"
    attempts = []
    for n, kill_after in enumerate([*schedule, -1.0]):
        machine = Machine(root / ("machine" if way == "warm-local" else f"machine{n}"))
        truth = root / f"attempt{n}.jsonl"
        log_path = root / f"gxx{n}.log"
        env = {**clean_env(), **machine.env(), **gxx.env(log_path), "TRUTH": str(truth),
               "STEPS": str(args.steps), "CKPT_EVERY": str(args.ckpt_every),
               "STEP_S": str(args.step_s), "KILL_AFTER_S": str(kill_after),
               "CKPT": str(ckpt), "MODEL": args.model, "OMP_NUM_THREADS": "1"}
        if way == "megacache" and server is not None:
            env |= {"MEGACACHE_URL": server.url, "MEGACACHE_JOB_ID": job,
                    "MEGACACHE_MODEL": f"recovery-{args.model}-{root.name}",
                    "MEGACACHE_ATTEMPT": str(n)}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trainer"],
                              env=env, capture_output=True, text=True, timeout=1800)
        facts = read_truth(truth)
        if proc.returncode not in (0, -signal.SIGKILL):
            raise RuntimeError(f"{way} attempt {n}: exit {proc.returncode}\n"
                               f"{proc.stderr[-3000:]}")
        attempts.append({"facts": facts, "gxx": GxxCounter.builds(log_path)})
        if proc.returncode == 0:  # finished (before its kill, when --steps is short)
            break
    return {"job": job, "attempts": attempts, **clock(attempts)}


def clock(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures by its own clock: time to start, each time to recover, checkpoint
    save time, unsaved training time, training, wall and ETT%."""
    by = [{f["fact"]: f for f in a["facts"]} | {"saves": [f for f in a["facts"]
                                                          if f["fact"] == "save"]}
          for a in attempts]
    start = by[0]["started"]["at0"]
    end = by[-1]["end"]["at"]
    ttr, lost, training, saving = [], 0.0, 0.0, 0.0
    for i, a in enumerate(by):
        stop = a["kill"]["at"] if "kill" in a else a["end"]["at"]
        blocking = sum(s["blocking_s"] for s in a["saves"])
        saving += blocking
        if "kill" in a:
            last = a["saves"][-1]["at"] if a["saves"] else a["first_step"]["at"]
            lost += stop - last
            training += last - a["first_step"]["at"] - blocking
            ttr.append(by[i + 1]["first_step"]["at"] - stop)
        else:
            training += stop - a["first_step"]["at"] - blocking
    wall = end - start
    return {"time_to_start_s": by[0]["first_step"]["at"] - start, "time_to_recover_s": ttr,
            "checkpoint_save_s": saving, "unsaved_training_s": lost, "training_s": training,
            "wall_s": wall, "ett_pct": 100 * training / wall,
            "gxx_per_restart": [a["gxx"] for a in attempts[1:]]}


def server_figures(server: LocalServer, job: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.get(f"{server.url}/v1/jobs/{job}/ett", timeout=30)
        if r.status_code == 200 and r.json()["attempts"][-1]["ended"]:
            body = r.json()
            return {"time_to_start_s": body["time_to_start_s"],
                    "time_to_recover_s": [a["time_to_recover_s"] for a in body["attempts"][1:]],
                    "checkpoint_save_s": body["checkpoint_save_s"],
                    "unsaved_training_s": body["unsaved_training_s"],
                    "training_s": body["seconds"]["training"], "wall_s": body["wall_s"],
                    "ett_pct": body["ett_pct"]}
        time.sleep(0.5)
    raise RuntimeError(f"the server has no ended split of {job}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--ckpt-every", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--kill-range", default="2,8", help="seconds of training before a kill, "
                   "drawn uniformly from this range")
    p.add_argument("--seed", type=int, default=46)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "recovery.json")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.kills, args.repeats, args.steps, args.kill_range = 1, 1, 80, "1,2"
    low, high = (float(x) for x in args.kill_range.split(","))
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    from benchmarks.harness.benchlib import temp_root

    with temp_root("megacache-recovery-", args.keep) as root:
        gxx = GxxCounter(root / "bin")
        server = LocalServer(root / "server" / "data").start()
        try:
            for r in range(args.repeats):
                schedule = [round(rng.uniform(low, high), 2) for _ in range(args.kills)]
                for way in WAYS:  # side by side: the same kills, one way after another
                    log(f"repeat {r + 1}/{args.repeats}, {way}: kills after {schedule} s")
                    run = one_job(way, schedule, root / f"{way}-{r}", args, server, gxx)
                    if way == "megacache":
                        run["server"] = server_figures(server, run["job"])
                    runs[way].append({"schedule": schedule, **run})
        finally:
            server.stop()
    summary = summarise(runs)
    print(report(summary))
    rows = [{"way": way, **row} for way, row in summary["ways"].items()]
    write_record(make_record(
        "recovery_bench", given_argv(argv), rows,
        server_minus_clock=summary["server_minus_clock"],
        runs={w: [{k: v for k, v in run.items() if k != "attempts"} for run in rs]
              for w, rs in runs.items()}), args.out)
    log(f"wrote {args.out}")
    return 0


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ways = {}
    for way, rs in runs.items():
        ttr = [t for r in rs for t in r["time_to_recover_s"]]
        ways[way] = {"time_to_recover_s": median(ttr), "restarts": len(ttr),
                     "gxx_per_restart": median([g for r in rs for g in r["gxx_per_restart"]]),
                     "ett_pct": median(r["ett_pct"] for r in rs),
                     "wall_s": median(r["wall_s"] for r in rs)}
    warm = ways["warm-local"]["time_to_recover_s"]
    for w in ways.values():
        w["ttr_vs_warm_local"] = round(w["time_to_recover_s"] / warm, 3) if warm else None
    names = ("time_to_start_s", "checkpoint_save_s", "unsaved_training_s", "training_s",
             "wall_s", "ett_pct")
    diffs: dict[str, list[float]] = {n: [] for n in (*names, "time_to_recover_s")}
    for r in runs["megacache"]:
        for n in names:
            diffs[n].append(r["server"][n] - r[n])
        diffs["time_to_recover_s"] += [s - c for s, c in zip(
            r["server"]["time_to_recover_s"], r["time_to_recover_s"], strict=False)]
    return {"ways": ways, "server_minus_clock": {
        n: {"max_abs": round(max((abs(d) for d in ds), default=0.0), 3),
            "median": round(median(ds), 3)} for n, ds in diffs.items()}}


def report(summary: dict[str, Any]) -> str:
    rows = [(way, fmt_num(w["time_to_recover_s"], "{:.2f}"),
             fmt_num(w["ttr_vs_warm_local"], "{:.2f}x"), fmt_num(w["gxx_per_restart"]),
             fmt_num(w["ett_pct"], "{:.1f}"), fmt_num(w["wall_s"], "{:.1f}"))
            for way, w in summary["ways"].items()]
    out = text_table(("way", "time to recover s (median)", "vs warm-local",
                      "g++ builds per restart", "ETT %", "wall s"), rows)
    diff = [(n, fmt_num(d["median"], "{:+.2f}"), fmt_num(d["max_abs"], "{:.2f}"))
            for n, d in summary["server_minus_clock"].items()]
    return out + "\n\nmegacache: the server's ETT minus the job's own clock\n" + text_table(
        ("figure", "median", "max |diff|"), diff)


if __name__ == "__main__":
    sys.exit(main())
