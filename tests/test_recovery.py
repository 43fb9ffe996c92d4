"""Recovery (#46): a failed attempt leaves its compile and its time line behind, with the
default settings, against a real server.

- A torchrun job (2 ranks, `model.compile()`, zero-code) whose rank 0 is SIGKILLed right
  after its first step, before any settled round published, restarts as on new machines
  (fresh caches for each attempt) and starts warm: FX graph hits, no miss, no g++ build.
  What it finds is what the SIGTERM torchrun sent rank 1 published (`steps/preemption.py`).
  The killed attempt reported its start.
- SIGTERM: with Python's default action the process still ends by SIGTERM, within the grace,
  having finished its publish and sent the attempt's end, also when the signal comes while
  the exit publishes (a rank that raised as its peer died) or while the exception's end is
  sent; a trainer's own handler still runs
  (ours hands the signal on); a main thread stuck in native code still ends promptly.
- A short outage near the end loses no save and not the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess, ett_of, free_port

from benchmarks.harness.machines import GxxCounter, Machine, clean_env, run_job

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
GRACE_S = 20.0  # the default MEGACACHE_TERM_GRACE_S


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("recovery") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def name(tmp_path: Path, what: str) -> str:
    return f"{what}-{tmp_path.name[-10:]}-{int(time.time() * 1000) % 10**8}".replace("_", "-")


def test_a_killed_rank_leaves_its_compile_behind(cache: ServerProcess, tmp_path: Path,
                                                 toolchain: Path) -> None:
    need("torch", "the job compiles a real model")
    job, model = name(tmp_path, "killed"), name(tmp_path, "tiny")
    results, machines = tmp_path / "results", tmp_path / "machines"
    results.mkdir()
    Machine(machines / "attempt0", toolchain)  # the first attempt's node has compiled before
    runner = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--max-restarts", "1", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", job,
              str(HERE / "recovery_job.py")]
    run = run_job(Machine(tmp_path / "launcher"), runner=runner, timeout=900,
                  gxx=GxxCounter(tmp_path / "bin"),
                  env={"MEGACACHE_URL": cache.url, "MEGACACHE_MODEL": model,
                       "MEGACACHE_JOB_ID": job, "OMP_NUM_THREADS": "1",
                       "RESULT_DIR": str(results), "MACHINES": str(machines),
                       "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent / 'benchmarks'}"})
    assert run.returncode == 0, run.stderr[-4000:]  # attempt 1 finished the job
    # killed at the realistic point: the compile done, nothing published by a settled
    # round yet; what attempt 1 loads, rank 1's SIGTERM (from torchrun's agent) published
    assert "rank 0 killed after step 1; published before the kill: False" in run.stderr, \
        run.stderr[-4000:]
    assert GxxCounter.builds(machines / "attempt0" / "gxx.log") > 0  # a cold compile
    for rank in (0, 1):  # the restart, on new machines: warm, compiling nothing
        seen = json.loads((results / f"rank{rank}-attempt1.json").read_text())
        # served from the cache: FX graphs, AOTAutograd entries (precompile on bundles the
        # compiled graph in them: no FX lookup) or precompiled Dynamo once verified
        assert seen["fxgraph_hit"] + seen["aot_hit"] + seen["precompile_hit"] >= 1, seen
        assert seen["fxgraph_miss"] == 0, seen
    assert GxxCounter.builds(machines / "attempt1" / "gxx.log") == 0
    # the killed attempt sent its cache event right after its first step: its start counts
    (record,) = [j for j in httpx.get(f"{cache.url}/v1/jobs", timeout=30).json()["jobs"]
                 if j["job_id"] == job]
    attempts = {a["attempt"]: a for a in record["attempts"]}
    assert attempts[0]["outcome"] == "miss" and attempts[0]["seconds"] is not None, record
    assert attempts[1]["outcome"] == "hit", record


def entry_puts(url: str) -> float:
    """Entry writes the server counted (`PUT /v1/ac/{key}`, any status)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("megacache_http_requests_total{")
               and 'method="PUT"' in line and 'route="/v1/ac/{key}"' in line)


@pytest.mark.parametrize("rounds", [4, 1])
def test_later_compiles_publish_again_once_each_within_the_cap(
        tmp_path: Path, rounds: int, toolchain: Path) -> None:
    """Two waves of compiles: the first settled point publishes the first, the next one
    the second (the union); the exit has nothing new and writes nothing. With a cap of one
    round, the second wave stays unpublished. Precompiled Dynamo is off here: its verified
    entries come in rounds of their own whenever the child's check ends
    (`test_sigterm_finishes_the_publish_sends_the_end_and_ends_the_process`,
    test_precompile_verify.py), which would make the count of writes a race."""
    need("torch", "the job compiles a real model")
    server = ServerProcess(tmp_path / "data").start()
    try:
        model = name(tmp_path, "waves")
        run = run_job(Machine(tmp_path / "node", toolchain),
                      runner=[sys.executable, str(HERE / "rounds_job.py")],
                      env={"MEGACACHE_URL": server.url, "MEGACACHE_MODEL": model,
                           "MEGACACHE_MAX_PUBLISHES": str(rounds), "OMP_NUM_THREADS": "1",
                           "MEGACACHE_PRECOMPILE": "0",
                           "ROUNDS_WAIT": "60" if rounds > 1 else "5"},
                      timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        first, second = run.result["first"], run.result["second"]
        assert first is not None and second is not None, run.result
        if rounds > 1:
            assert second["inductor"] > first["inductor"], run.result  # the union
            assert entry_puts(server.url) == 2  # one write per wave, none at exit
        else:
            assert second == first, run.result
            assert entry_puts(server.url) == 1
    finally:
        server.stop()


# -- SIGTERM and outages: one trainer process each ----------------------------------------
def start(cache_url: str, tmp_path: Path, mode: str, job: str, toolchain: Path | None = None,
          **env: str) -> tuple[subprocess.Popen[str], Path]:
    """The trainer started on a new node (`toolchain`: one whose toolchain is built, for a
    trainer that compiles) and ready."""
    need("torch", "the trainer is torch's")
    machine = Machine(tmp_path / "node", toolchain)
    ready = tmp_path / "ready"
    full = {**clean_env(), **machine.env(), "MEGACACHE_URL": cache_url,
            "MEGACACHE_JOB_ID": job, "MODE": mode, "READY": str(ready),
            "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.Popen([sys.executable, str(HERE / "preempt_job.py")], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the trainer never got ready: {proc.communicate()[1]}")
        time.sleep(0.05)
    return proc, ready


def saves(path: Path) -> int:
    """The checkpoints the outage job has saved so far (0 before its first count)."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):  # not yet written, or caught mid-write
        return 0


def burning(pid: int) -> bool:
    """Whether the process's main thread is running (state R), not waiting."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "R"


def terminate(proc: subprocess.Popen[str]) -> tuple[float, float]:
    """SIGTERM now; (when it was sent, seconds until the process ended)."""
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("SIGTERM did not end the trainer within 60 s") from None
    return sent, time.time() - sent


def test_sigterm_finishes_the_publish_sends_the_end_and_ends_the_process(
        cache: ServerProcess, tmp_path: Path, toolchain: Path) -> None:
    job, model = name(tmp_path, "term"), name(tmp_path, "term-model")
    proc, _ = start(cache.url, tmp_path, "default", job, toolchain, COMPILE="1",
                    MEGACACHE_MODEL=model)
    sent, took = terminate(proc)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, stderr[-3000:])
    assert took < GRACE_S + 3, (took, stderr[-3000:])
    entries = httpx.get(f"{cache.url}/v1/ac", params={"model": model}, timeout=10).json()
    assert entries["entries"], "the compile was not published before the process ended"
    (attempt,) = ett_of(cache.url, job)["attempts"]
    assert attempt["ended"] == "failed" and attempt["failed"], attempt
    assert (attempt["cause"], attempt["cause_detail"]) == ("preempted", "SIGTERM"), attempt
    assert abs(attempt["end"] - sent) < 1.5, (attempt["end"], sent)


def test_sigterm_during_the_exit_s_publish_lets_it_finish(cache: ServerProcess,
                                                          tmp_path: Path,
                                                          toolchain: Path) -> None:
    """A rank whose collective failed when a peer died raises; its exit publishes, and the
    launcher's SIGTERM (sent as it saw the peer die) comes meanwhile: the handler waits for
    that round within the grace, where handing the signal on at once would end it."""
    job, model = name(tmp_path, "crash"), name(tmp_path, "crash-model")
    proc, _ = start(cache.url, tmp_path, "crash", job, toolchain, MEGACACHE_MODEL=model)
    _, took = terminate(proc)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, stderr[-3000:])
    assert took < GRACE_S + 3, (took, stderr[-3000:])
    entries = httpx.get(f"{cache.url}/v1/ac", params={"model": model}, timeout=10).json()
    assert entries["entries"], f"the exit's publish was cut short: {stderr[-3000:]}"


def test_sigterm_while_the_end_is_sent_lets_it_arrive(cache: ServerProcess,
                                                      tmp_path: Path) -> None:
    """The same rank, its exception's end on its way when the SIGTERM comes: the handler
    waits for it (bounded), where handing the signal on at once would lose it, and the
    failure would be dated by the last heartbeat (the ETT of a killed torchrun job's rank)."""
    job = name(tmp_path, "raise")
    proc, _ = start(cache.url, tmp_path, "raise", job)
    raised = time.time()
    _, took = terminate(proc)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == -signal.SIGTERM and took < GRACE_S + 3, (proc.returncode,
                                                                      stderr[-3000:])
    (attempt,) = ett_of(cache.url, job)["attempts"]
    assert attempt["ended"] == "failed", (attempt, stderr[-3000:])
    assert attempt["cause"] == "exception" and abs(attempt["end"] - raised) < 1.5, attempt


def test_sigterm_goes_on_to_the_trainer_s_own_handler(cache: ServerProcess,
                                                      tmp_path: Path) -> None:
    job = name(tmp_path, "own")
    marker = tmp_path / "marker"
    proc, _ = start(cache.url, tmp_path, "own", job, MARKER=str(marker))
    sent, took = terminate(proc)
    assert proc.returncode == 3, proc.stderr.read() if proc.stderr else ""
    assert marker.exists() and took < GRACE_S + 3
    (attempt,) = ett_of(cache.url, job)["attempts"]
    # ours ran first: a sign of life at the signal; the trainer's handler then exited with
    # sys.exit(3): the attempt failed, preempted (the SIGTERM came first), code 3 noted
    assert attempt["ended"] == "failed" and abs(attempt["end"] - sent) < 1.5, attempt
    assert (attempt["cause"], attempt["exit_code"]) == ("preempted", 3), attempt
    assert attempt["cause_detail"] == "SIGTERM, then exit code 3", attempt


def test_sigterm_ends_a_trainer_stuck_in_native_code(cache: ServerProcess,
                                                     tmp_path: Path) -> None:
    """Python runs handlers between bytecodes only: without the watcher thread, a SIGTERM
    to a main thread inside a long native call would wait for the call (here ~minutes)."""
    job = name(tmp_path, "stuck")
    proc, _ = start(cache.url, tmp_path, "stuck", job)
    deadline = time.monotonic() + 30
    while not burning(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # ready, then straight into the native call: it burns a core
    sent, took = terminate(proc)
    assert proc.returncode == -signal.SIGTERM and took < GRACE_S + 3, (proc.returncode, took)
    (attempt,) = ett_of(cache.url, job)["attempts"]
    assert attempt["ended"] == "failed" and abs(attempt["end"] - sent) < 1.5, attempt


def test_a_short_outage_near_the_end_loses_no_save_and_not_the_end(
        tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data").start()
    try:
        job = name(tmp_path, "outage")
        saved = tmp_path / "saved"
        proc, _ = start(server.url, tmp_path, "outage", job, SAVES="20", SAVED=str(saved))
        server.stop()  # down after the third save
        down = time.monotonic()
        before = saves(saved)
        deadline = down + 60  # the event the outage is for: saves made while it is down
        while saves(saved) < before + 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "the job saved nothing during the outage"
            time.sleep(0.05)
        server.start()
        up = time.monotonic()
        alive_after_the_outage = proc.poll() is None
        out, err = proc.communicate(timeout=120)
        ended = time.monotonic()
        assert proc.returncode == 0, err[-3000:]
        assert alive_after_the_outage, "the job ended during the outage: nothing reached it"
        (attempt,) = ett_of(server.url, job)["attempts"]
        assert attempt["checkpoint_saves"] == 20, (attempt, up - down, ended - up)
        assert attempt["ended"] == "finished" and not attempt["live"], attempt
    finally:
        server.stop()
