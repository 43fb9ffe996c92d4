"""Why each failure happened and where each recovery went (#60), end to end with the
default settings: one job per cause (tests/ett_causes_job.py, zero-code, a real server),
each failing once and run again, against the job's own clock.

For each cause the server must name it (the attempt's `cause`, and what names it), and its
unsaved training time and time to recover must agree with the job's own clock: within
0.5 s where the failure is dated by the attempt's own end (SIGTERM, an exception, an OOM,
`sys.exit(3)`) or its lifeline on the node (SIGKILL, run again on the same node); a job
run again on another node (`lost`: SLURM's variables name it there) is dated by the last
record the killed attempt sent, so the bound grows by the time from it to the kill. The
recovery's components (`ett_components`) add up to its time to recover, and each one the
job timed itself is within 0.5 s of its own clock.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import need
from helpers import ServerProcess, ett_of
from jobs import Machine, clean_env, run_job

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
TOLERANCE_S = 0.5
JOB_ENV = {"OMP_NUM_THREADS": "1", "MEGACACHE_MODE": "read-only", "STEPS": "12",
           "CKPT_EVERY": "4", "FAIL_AT": "10", "STEP_S": "0.1"}
CASES: dict[str, tuple[str, str, int | None]] = {
    "sigterm": ("preempted", "SIGTERM", None),
    "exception": ("exception", "ValueError", None),
    "oom": ("oom", "RuntimeError", None),
    "exit3": ("exit_code", "exit code 3", 3),
    "sigkill": ("killed", "no end record", None),
    "elsewhere": ("lost", "nothing later", None),
}
"""Each run-0 failure: the cause the server must name, a word of its detail, the exit
code it must carry. `elsewhere`: SIGKILL, run again on another node."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = ServerProcess(tmp_path_factory.mktemp("causes") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


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
    """Run 0, failing by `case`; for SIGTERM, when the test sent it."""
    cmd = [sys.executable, str(HERE / "ett_causes_job.py")]
    if case != "sigterm":
        run = run_job(machine, runner=cmd, env=env, timeout=300)
        assert run.returncode != 0, run.stderr[-3000:]
        return None
    full = {**clean_env(), **machine.env(), **env}
    proc = subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.02)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.returncode
    return sent


def job_of(machine: Machine) -> str:
    """The job id the node's record of the command gave (zero-code: nothing named it)."""
    (record,) = (machine.root / "node" / "runs").glob("*.json")
    return str(json.loads(record.read_text())["job"])


@pytest.mark.parametrize("case", list(CASES))
def test_one_job_per_cause_against_its_own_clock(cache: ServerProcess, tmp_path: Path,
                                                 case: str) -> None:
    need("torch", "the trainer is torch's")
    truth, ckpt, ready = tmp_path / "truth", tmp_path / "ckpt", tmp_path / "ready"
    truth.mkdir()
    ckpt.mkdir()
    env = {**JOB_ENV, "MEGACACHE_URL": cache.url, "TRUTH_DIR": str(truth),
           "CKPT_DIR": str(ckpt), "READY": str(ready),
           "CAUSE": "sigkill" if case == "elsewhere" else case}
    slurm = f"{case}-{int(time.time() * 1000) % 10**9}"
    here = Machine(tmp_path / "node")
    sent = run_0(case, here, {**env, "RUN": "0", **(
        {"SLURM_JOB_ID": slurm, "SLURM_RESTART_COUNT": "0"} if case == "elsewhere" else {})},
        ready)
    there = Machine(tmp_path / "other") if case == "elsewhere" else here
    run = run_job(there, runner=[sys.executable, str(HERE / "ett_causes_job.py")],
                  env={**env, "RUN": "1", **({"SLURM_JOB_ID": slurm,
                                              "SLURM_RESTART_COUNT": "1"}
                                             if case == "elsewhere" else {})}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    job = slurm if case == "elsewhere" else job_of(here)
    ett = ett_of(cache.url, job, attempts=2)
    a0, a1 = ett["attempts"]
    f0, f1 = facts(truth, 0), facts(truth, 1)

    cause, word, code = CASES[case]
    assert (a0["cause"], a0["failed"], a1["cause"]) == (cause, True, None), (a0, a1)
    assert word in (a0["cause_detail"] or ""), a0
    assert a0["exit_code"] == code, a0
    row = {r["cause"]: r for r in ett["failures_by_cause"]}
    assert list(row) == [cause] and row[cause]["failures"] == 1, ett["failures_by_cause"]

    failed_at = sent if sent is not None else f0["fail"]["at"]
    snapshot = max(s["at"] for s in f0["save"])
    unsaved = failed_at - snapshot
    recover = f1["first_step_end"]["at"] - failed_at
    slack = TOLERANCE_S
    if case == "elsewhere":  # dated by the last record sent: the last save's, once durable
        last = max(s["at"] + s["blocking_s"] for s in f0["save"])
        slack += failed_at - last
    problems = []
    for what, server, own in (("unsaved training", a0["lost_s"], unsaved),
                              ("time to recover", a1["time_to_recover_s"], recover)):
        if abs(server - own) > slack:
            problems.append(f"{what}: server {server:.3f} s, the job's clock {own:.3f} s")
    assert abs(row[cause]["unsaved_training_s"] - a0["lost_s"]) < 0.002, row
    assert abs(row[cause]["recovery_s"] - a1["time_to_recover_s"]) < 0.002, row

    parts = a1["components"]
    assert parts is not None, a1
    seconds = parts["seconds"]
    assert abs(sum(seconds.values()) - a1["time_to_recover_s"]) < 0.01, (seconds, a1)
    assert parts["process_groups"] == f1["distributed"]["groups"], parts
    for name, own in (("distributed", f1["distributed"]["seconds"]),
                      ("model_build", f1["model_build"]["seconds"]),
                      ("checkpoint_restore", f1["restore"]["seconds"]),
                      ("first_batch", f1["first_batch"]["seconds"]),
                      ("imports", f1["imported"]["at"] - f1["started"]["at"]),
                      ("restart_wait", f1["started"]["at"] - failed_at)):
        if abs(seconds[name] - own) > (slack if name == "restart_wait" else TOLERANCE_S):
            problems.append(f"{name}: server {seconds[name]:.3f} s, the job's clock "
                            f"{own:.3f} s")
    assert not problems, (problems, a0, a1)
