"""Why each failure happened and where the recovery went: one job per cause, the server's
figures beside the job's own clock.

For each cause, `ett_causes_job.py` (zero-code, the default settings, a local server)
trains with DCP checkpoints every 4 steps and fails after step 10: SIGTERM (the default
action), an uncaught exception, a real out-of-memory error (an allocation of 4 EiB),
`sys.exit(3)`, SIGKILL; then it is run again on the same node (a rerun of the same
command: its next attempt), or, for `elsewhere`, SIGKILLed and run again on another node
(SLURM's variables name the job there). The tables: the cause the server names, the
unsaved training time and time to recover (server / the job's clock), and for one restart
the components of its time to recover (server / the job's clock).

    python -m benchmarks ett_causes                       # every cause
    python -m benchmarks ett_causes --causes oom,sigkill

Results: tables on stdout, JSON (`--out`, default benchmarks/results/ett_causes.json).
tests/test_ett_causes.py holds the same figures to their bounds.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.frameworks_ett import ended_ett
from benchmarks.harness import ETT_CAUSES_JOB
from benchmarks.harness.benchlib import (
    BENCH_DIR,
    log,
    temp_root,
    text_table,
)
from benchmarks.harness.machines import Machine, clean_env, run_job
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer

JOB = ETT_CAUSES_JOB
SETTINGS = {"OMP_NUM_THREADS": "1", "MEGACACHE_MODE": "read-only", "STEPS": "12",
            "CKPT_EVERY": "4", "FAIL_AT": "10", "STEP_S": "0.1"}
CASES: dict[str, tuple[str, str, int | None]] = {
    "sigterm": ("preempted", "SIGTERM", None),
    "exception": ("exception", "ValueError", None),
    "oom": ("oom", "RuntimeError", None),
    "exit3": ("exit_code", "exit code 3", 3),
    "sigkill": ("killed", "no end record", None),
    "elsewhere": ("lost", "nothing later", None),
}
"""Each run-0 failure: the cause the server must name, a word of its detail, the exit code
it must carry. `elsewhere`: SIGKILL, run again on another node."""
TIMED = ("restart_wait", "imports", "distributed", "model_build", "checkpoint_restore",
         "first_batch")
"""The components of a recovery the job times itself (the rest have no clock of the job's:
the first step's remainder, compile, other)."""


def facts(truth: Path, run: int) -> dict[str, Any]:
    """The run's facts by name (saves as a list)."""
    out: dict[str, Any] = {"save": []}
    for line in (truth / f"run{run}.jsonl").read_text().splitlines():
        fact = json.loads(line)
        if fact["fact"] == "save":
            out["save"].append(fact)
        else:
            out[fact["fact"]] = fact
    return out


def run_0(case: str, machine: Machine, env: dict[str, str], ready: Path) -> float | None:
    """Run 0, failing by `case`; for SIGTERM, when it was sent."""
    cmd = [sys.executable, str(JOB)]
    if case != "sigterm":
        run = run_job(machine, runner=cmd, env=env, timeout=300)
        if run.returncode == 0:
            raise RuntimeError(f"{case}: run 0 did not fail\n{run.stderr[-3000:]}")
        return None
    full = {**clean_env(), **machine.env(), **env}
    proc = subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{case}: never ready\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    if proc.returncode != -signal.SIGTERM:
        raise RuntimeError(f"sigterm: run 0 ended {proc.returncode}")
    return sent


def job_of(machine: Machine) -> str:
    """The job id the node's record of the command gave (zero-code: nothing named it)."""
    (record,) = (machine.root / "node" / "runs").glob("*.json")
    return str(json.loads(record.read_text())["job"])


def run_case(case: str, url: str, root: Path) -> dict[str, Any]:
    """Run 0 failing by `case`, run 1 recovering: the server's ETT, the job's facts, and
    the figures (server, the job's clock), with the bound they are held to."""
    truth, ckpt, ready = root / "truth", root / "ckpt", root / "ready"
    truth.mkdir(parents=True)
    ckpt.mkdir()
    env = {**SETTINGS, "MEGACACHE_URL": url, "TRUTH_DIR": str(truth), "CKPT_DIR": str(ckpt),
           "READY": str(ready), "CAUSE": "sigkill" if case == "elsewhere" else case}
    slurm = f"{case}-{int(time.time() * 1000) % 10**9}"

    def named(attempt: int) -> dict[str, str]:
        return {"SLURM_JOB_ID": slurm, "SLURM_RESTART_COUNT": str(attempt)} \
            if case == "elsewhere" else {}

    here = Machine(root / "node")
    sent = run_0(case, here, {**env, "RUN": "0", **named(0)}, ready)
    there = Machine(root / "other") if case == "elsewhere" else here
    run = run_job(there, runner=[sys.executable, str(JOB)],
                  env={**env, "RUN": "1", **named(1)}, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"{case}: run 1 failed\n{run.stderr[-3000:]}")
    ett = ended_ett(url, slurm if case == "elsewhere" else job_of(here))
    f0, f1 = facts(truth, 0), facts(truth, 1)
    a0, a1 = ett["attempts"]
    failed_at = sent if sent is not None else f0["fail"]["at"]
    bound = 0.5
    if case == "elsewhere":  # dated by the last record sent: the last save's, once durable
        bound += failed_at - max(s["at"] + s["blocking_s"] for s in f0["save"])
    clock = {"restart_wait": f1["started"]["at"] - failed_at,
             "imports": f1["imported"]["at"] - f1["started"]["at"],
             "distributed": f1["distributed"]["seconds"],
             "model_build": f1["model_build"]["seconds"],
             "checkpoint_restore": f1["restore"]["seconds"],
             "first_batch": f1["first_batch"]["seconds"]}
    parts = a1["components"]["seconds"]
    return {
        "ett": ett, "truth": [f0, f1], "bound_s": bound,
        "cause": a0["cause"], "detail": a0["cause_detail"], "exit_code": a0["exit_code"],
        "figures": {
            "unsaved training": (a0["lost_s"], failed_at - max(s["at"] for s in f0["save"])),
            "time to recover": (a1["time_to_recover_s"],
                                f1["first_step_end"]["at"] - failed_at)},
        "components": {name: (parts[name], clock.get(name)) for name in parts},
        "process_groups": (a1["components"]["process_groups"], f1["distributed"]["groups"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--causes", default=",".join(CASES))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "ett_causes.json")
    args = p.parse_args(argv)
    found: dict[str, Any] = {}
    with temp_root("megacache-causes-", False) as root:
        server = LocalServer(root / "server" / "data").start()
        try:
            for case in args.causes.split(","):
                log(f"{case}: run 0 fails, run 1 recovers")
                done = run_case(case, server.url, root / case)
                found[case] = {k: v for k, v in done.items() if k not in ("ett", "truth")}
        finally:
            server.stop()
    print(text_table(("failure", "cause (server)", "why", "unsaved s (server / clock)",
                      "recover s (server / clock)"), [
        (case, f["cause"], f["detail"] or "-",
         "{:.3f} / {:.3f}".format(*f["figures"]["unsaved training"]),
         "{:.3f} / {:.3f}".format(*f["figures"]["time to recover"]))
        for case, f in found.items()]))
    for case, f in found.items():
        print(f"\n{case}: time to recover by component (server / the job's clock)")
        print(text_table(("component", "server s", "job's clock s"), [
            (name, f"{s:.3f}", "-" if c is None else f"{c:.3f}")
            for name, (s, c) in f["components"].items() if s or c]))
        break  # one restart's bar
    write_record(make_record("ett_causes", given_argv(argv),
                             [{"cause": cause, **row} for cause, row in found.items()]),
                 args.out)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
