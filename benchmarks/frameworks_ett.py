"""ETT for the trainers people run: each framework's job, killed and resumed, the server's
figures beside the job's own clock.

For each installed framework (the Hugging Face Trainer, Accelerate, lightning,
pytorch_lightning), `framework_job.py` trains a tiny model zero-code with the default
settings against a local server, saves a checkpoint the framework's own way every 5 steps,
is SIGKILLed 3 steps after step 10's checkpoint and resumed on the same node; its data
loader sleeps 10 ms a sample. The table: checkpoint save time (attempt 0), the restore,
unsaved training time, time to recover and data wait (attempt 1), server and clock.

    python -m benchmarks frameworks_ett                 # every installed framework
    python -m benchmarks frameworks_ett --frameworks hf

Results: a table per framework on stdout, JSON (`--out`, default
benchmarks/results/frameworks_ett.json). tests/test_frameworks.py holds the same figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import FRAMEWORK_JOB
from benchmarks.harness.benchlib import (
    BENCH_DIR,
    log,
    temp_root,
    text_table,
)
from benchmarks.harness.machines import Machine, run_job
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer

JOB = FRAMEWORK_JOB
PACKAGES = {"hf": "transformers", "accelerate": "accelerate", "lightning": "lightning",
            "pytorch_lightning": "pytorch_lightning"}
SETTINGS = {"STEPS": "20", "EVERY": "5", "KILL_AT": "10", "KILL_AFTER": "3",
            "KILL_DELAY_S": "2.5", "DATA_S": "0.01", "OMP_NUM_THREADS": "1"}
"""KILL_DELAY_S: the killed attempt trains 2.5 s past its last checkpoint, so its unsaved
training time is well beyond the ±1 s the server is held to: a server that dated the kill
by the last record it got (the checkpoint) instead of the attempt's lifeline would be off
by 2.5 s."""


def run(framework: str, url: str, root: Path) -> tuple[dict[int, dict[str, list[Any]]],
                                                       dict[str, Any], list[str]]:
    """Attempt 0 (killed) and 1 (resumed): (the job's facts per attempt, the server's ETT,
    each attempt's stderr)."""
    job = f"fw-{framework.replace('_', '-')}-{int(time.time() * 1000) % 10**8}"
    truth, machine = root / "truth.jsonl", Machine(root / "node")
    env = {**SETTINGS, "MEGACACHE_URL": url, "MEGACACHE_JOB_ID": job,
           "FRAMEWORK": framework, "TRUTH": str(truth), "OUT": str(root / "ckpt")}
    errors = []
    for attempt, code in ((0, -signal.SIGKILL), (1, 0)):
        done = run_job(machine, runner=[sys.executable, str(JOB)],
                       env={**env, "MEGACACHE_ATTEMPT": str(attempt)}, timeout=600)
        if done.returncode != code:
            raise RuntimeError(f"{framework} attempt {attempt}: exit {done.returncode}\n"
                               f"{done.stderr[-3000:]}")
        errors.append(done.stderr)
    return facts(truth), ended_ett(url, job), errors


def facts(path: Path) -> dict[int, dict[str, list[Any]]]:
    out: dict[int, dict[str, list[Any]]] = {}
    for line in path.read_text().splitlines():
        f = json.loads(line)
        out.setdefault(f["attempt"], {}).setdefault(f["fact"], []).append(f)
    return out


def ended_ett(url: str, job: str, timeout: float = 30.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = httpx.get(f"{url}/v1/jobs/{job}/ett", timeout=10)
        if r.status_code == 200 and len(r.json()["attempts"]) == 2 \
                and r.json()["attempts"][-1]["ended"]:
            return dict(r.json())
        time.sleep(0.25)
    raise RuntimeError(f"the server has no ended split of {job}")


def figures(truth: dict[int, dict[str, list[Any]]], ett: dict[str, Any]
            ) -> dict[str, tuple[float, float]]:
    """name -> (server, the job's clock)."""
    a0, a1 = ett["attempts"]
    saves0, kill = truth[0]["save"], truth[0]["kill"][0]
    last = saves0[-1]
    return {
        "checkpoint saves (attempt 0)": (a0["checkpoint_saves"], len(saves0)),
        "checkpoint save time (attempt 0)": (a0["checkpoint_blocking_s"],
                                             sum(s["blocking_s"] for s in saves0)),
        "unsaved training time": (a0["lost_s"],
                                  kill["at"] - (last["began"] + last["blocking_s"])),
        "time to recover": (a1["time_to_recover_s"],
                            truth[1]["first_step"][0]["at"] - kill["at"]),
        "data wait (attempt 1)": (a1["seconds"]["data_wait"], truth[1]["end"][0]["slept"]),
        "restores (attempt 1)": (a1["checkpoint_loads"], 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default=",".join(PACKAGES))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "frameworks_ett.json")
    args = p.parse_args(argv)
    found: dict[str, Any] = {}
    with temp_root("megacache-frameworks-", False) as root:
        server = LocalServer(root / "server" / "data").start()
        try:
            for fw in args.frameworks.split(","):
                if importlib.util.find_spec(PACKAGES[fw]) is None:
                    log(f"{fw}: {PACKAGES[fw]} is not installed; skipped")
                    continue
                log(f"{fw}: killed after a checkpoint, then resumed")
                truth, ett, _ = run(fw, server.url, root / fw)
                found[fw] = {"figures": figures(truth, ett), "ett_pct": ett["ett_pct"]}
                print(f"\n{fw} (ETT {ett['ett_pct']}%)")
                print(text_table(("figure", "server", "job's clock"), [
                    (name, f"{s:.3f}", f"{c:.3f}")
                    for name, (s, c) in found[fw]["figures"].items()]))
        finally:
            server.stop()
    write_record(make_record("frameworks_ett", given_argv(argv),
                             [{"framework": fw, **row} for fw, row in found.items()]),
                 args.out)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
