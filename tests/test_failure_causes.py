"""A cause for every failure, and a job for every run (#60): the client's side, with real
exceptions, real exits, real fatal signals and real run records on disk.

- `causes.of_exception` names torch's and the allocator's out-of-memory errors `oom`, a
  process group's timeout `collective_timeout` (a real gloo store timing out), anything
  else `exception`, looking through a wrapper's cause;
- `sys.exit(n)` is noted (atexit cannot see it): n != 0 is `exit_code`, 0 finished, a
  SystemExit the trainer caught and trained on is forgotten;
- a process killed by a fatal signal leaves a dump the restart reads
  (`postmortem.verdict`): SIGSEGV is `killed`, SIGABRT while the main thread waits in
  `torch.distributed` (the NCCL watchdog's abort) `collective_timeout`; a rise in the
  container's OOM kills names the OOM killer;
- the job of a command no launcher names is the node's record of its last run
  (`job/runs.py`); the launchers' variables name it where they can (`job.py`).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import need

from megacache_client.ett import causes, postmortem
from megacache_client.ett.lifeline import Lifeline
from megacache_client.job import JobIdentity, runs

NOW = 1_800_000_000.0


# -- exceptions -----------------------------------------------------------------------------
def raised(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001 (the exception is what is tested)
        return exc
    raise AssertionError("nothing was raised")


def test_out_of_memory_errors_are_oom_whatever_wraps_them() -> None:
    torch = need("torch", "torch's own errors")
    allocator = raised(lambda: torch.empty(1 << 62, dtype=torch.uint8))  # a real one
    assert causes.of_exception(allocator) == ("oom", "RuntimeError")
    assert causes.of_exception(torch.OutOfMemoryError("CUDA out of memory. Tried to "
                                                      "allocate 2.00 GiB"))[0] == "oom"
    assert causes.of_exception(torch.OutOfMemoryError("x"))[1] == "torch.OutOfMemoryError"
    assert causes.of_exception(MemoryError()) == ("oom", "MemoryError")

    def wrapped() -> None:
        try:
            torch.empty(1 << 62, dtype=torch.uint8)
        except RuntimeError as exc:
            raise ValueError("the framework's step failed") from exc

    assert causes.of_exception(raised(wrapped)) == ("oom", "RuntimeError")
    assert causes.of_exception(ValueError("a bug")) == ("exception", "ValueError")
    assert causes.of_exception(KeyboardInterrupt()) == ("exception", "KeyboardInterrupt")
    assert causes.of_exception(TimeoutError("an HTTP call"))[0] == "exception"


def test_a_process_group_that_times_out_is_a_collective_timeout() -> None:
    torch = need("torch", "a real gloo store")
    dist = torch.distributed
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=1),
                     wait_for_workers=False)
    exc = raised(lambda: dist.init_process_group(
        "gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=1)))
    assert causes.of_exception(exc) == ("collective_timeout", "torch.distributed.DistStoreError")
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                        "Timed out waiting 1000ms for recv operation to complete")
    assert causes.of_exception(gloo)[0] == "collective_timeout"


# -- sys.exit -------------------------------------------------------------------------------
def test_sys_exit_is_noted_and_a_caught_one_forgotten() -> None:
    watch = causes.ExitWatch()
    original = sys.exit
    watch.install()
    try:
        assert sys.exit is not original
        raised(lambda: sys.exit(3))
        assert watch.ending() == ("exit_code", "exit code 3", 3)
        watch.forget()  # the trainer caught it and trained on
        assert watch.ending() == (None, None, 0)
        raised(lambda: sys.exit(0))
        assert watch.ending() == (None, None, 0)
        raised(lambda: sys.exit("a message"))  # printed; Python exits with 1
        assert watch.ending()[2] == 1

        def handled() -> None:
            try:
                raise MemoryError()
            except MemoryError:
                sys.exit(1)

        raised(handled)
        assert watch.ending() == ("oom", "MemoryError, then exit code 1", 1)
    finally:
        watch.uninstall()
    assert sys.exit is original


EXITS = """
import sys, time
import megacache_client.ett.causes as causes
watch = causes.ExitWatch()
watch.install()
import atexit
atexit.register(lambda: print("ENDING", watch.ending()))
{body}
"""


@pytest.mark.parametrize(("body", "ending"), [
    ("sys.exit(3)", "('exit_code', 'exit code 3', 3)"),
    ("exit(4)", "('exit_code', 'exit code 4', 4)"),
    ("sys.exit(0)", "(None, None, 0)"),
    ("pass", "(None, None, 0)"),
])
def test_the_exit_handler_sees_the_code_a_process_ends_with(body: str, ending: str) -> None:
    """In a real interpreter: the code is what atexit handlers (the telemetry's) read."""
    out = subprocess.run([sys.executable, "-c", EXITS.format(body=body)],
                         capture_output=True, text=True, timeout=60)
    assert f"ENDING {ending}" in out.stdout, (out.stdout, out.stderr)


# -- fatal signals and the OOM killer, read by the restart -----------------------------------
CRASH = """
import os, sys, threading, time, pathlib
from megacache_client.ett import postmortem
postmortem.FatalDump(pathlib.Path(sys.argv[1])).enable()
if sys.argv[2] == "segv":
    import ctypes
    ctypes.string_at(0)
else:  # the NCCL watchdog's way: a C++ thread aborts while the main thread waits in c10d
    import datetime
    import torch.distributed as dist
    threading.Timer(1.0, os.abort).start()
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
"""


@pytest.mark.parametrize(("how", "cause", "word"), [
    ("segv", "killed", "SIGSEGV"),
    ("abort", "collective_timeout", "NCCL watchdog"),
])
def test_a_fatal_signal_leaves_what_the_restart_names(tmp_path: Path, how: str, cause: str,
                                                      word: str) -> None:
    if how == "abort":
        need("torch", "a process group waiting for its peer")
    dump = tmp_path / "attempt-0.fatal"
    out = subprocess.run([sys.executable, "-c", CRASH, str(dump), how], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode < 0, (out.returncode, out.stderr[-2000:])
    found = postmortem.verdict(dump, None, None)
    assert found[0] == cause and word in found[1], (found, dump.read_text()[-2000:])


def test_the_oom_killer_is_named_by_the_container_s_count() -> None:
    assert postmortem.verdict(None, 2, 3) == (
        "killed", "the OOM killer (the container's oom_kill count 2 -> 3)")
    assert postmortem.verdict(None, 3, 3) == ("killed", postmortem.SILENT)
    assert postmortem.verdict(None, None, None) == ("killed", postmortem.SILENT)


def test_the_cgroup_counter_is_found_in_v1_and_v2(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v2 / "pod" / "c").mkdir(parents=True)
    (v2 / "pod" / "c" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\n"
                                                    "oom_kill 1\n")
    (tmp_path / "cg2").write_text("0::/pod/c\n")
    assert postmortem._find_counter(v2, tmp_path / "cg2") == v2 / "pod/c/memory.events"
    (v1 / "memory" / "x").mkdir(parents=True)
    (v1 / "memory" / "x" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    (tmp_path / "cg1").write_text("4:memory:/x\n1:cpu:/\n")
    assert postmortem._find_counter(v1, tmp_path / "cg1") == v1 / "memory/x/memory.oom_control"


def test_an_orphan_s_lifeline_names_it_killed(tmp_path: Path) -> None:
    earlier = Lifeline(tmp_path, "job-1", 0)
    earlier.renew(1_800_000_000.0, 12)
    later = Lifeline(tmp_path, "job-1", 1)
    (sign,) = later.orphans()
    assert (sign.attempt, sign.at, sign.step, sign.cause) == (0, 1_800_000_000.0, 12,
                                                              "killed")
    assert later.orphans() == []  # reported once


# -- which job ------------------------------------------------------------------------------
def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    return int(proc.stdout)


def killed(run: runs.Run) -> None:
    """The run's process went without a word: its record names a process that is gone."""
    record = json.loads(run.path.read_text())
    run.path.write_text(json.dumps({**record, "pid": dead_pid(), "ticks": None}))


def test_a_rerun_after_a_failure_is_the_next_attempt(tmp_path: Path) -> None:
    argv = ["train.py", "--lr", "0.1"]
    key = runs.command_key(argv, "/work")
    first = runs.begin(tmp_path, key, None, argv)
    assert first is not None and first.attempt == 0 and first.job_id.startswith("train-")
    runs.end(first, "failed")
    again = runs.begin(tmp_path, key, None, argv)
    assert again is not None and (again.job_id, again.attempt) == (first.job_id, 1)
    killed(again)  # no end at all: the next run is the next attempt too
    third = runs.begin(tmp_path, key, None, argv)
    assert third is not None and (third.job_id, third.attempt) == (first.job_id, 2)
    runs.end(third, "finished")
    fresh = runs.begin(tmp_path, key, None, argv)
    assert fresh is not None and fresh.job_id != first.job_id and fresh.attempt == 0
    other = runs.begin(tmp_path, runs.command_key(["train.py", "--lr", "0.2"], "/work"),
                       None, argv)
    assert other is not None and other.job_id != fresh.job_id


def test_records_of_commands_not_run_for_a_month_go(tmp_path: Path) -> None:
    stale = tmp_path / ("0" * 32 + ".json")
    stale.write_text("{}")
    os.utime(stale, (time.time() - 40 * 86400,) * 2)
    kept = runs.begin(tmp_path, runs.command_key(["new.py"], "/"), None, ["new.py"])
    assert kept is not None and kept.path.exists() and not stale.exists()


def test_a_launcher_or_an_installed_module_is_no_job_of_its_own() -> None:
    torch = need("torch", "its compile workers' module path")
    from megacache_client.job import _helper_process

    assert not _helper_process(["/home/me/train.py"])
    assert _helper_process(["/venv/bin/torchrun"])  # torchrun's agent
    worker = Path(torch.__file__).parent / "_inductor" / "compile_worker" / "__main__.py"
    assert _helper_process([str(worker)])  # Inductor's compile workers


def test_a_run_still_going_is_not_continued(tmp_path: Path) -> None:
    """The same command started twice at once: two jobs (the first run's process, this
    one, is alive and has not ended)."""
    key = runs.command_key(["x.py"], "/")
    first = runs.begin(tmp_path, key, None, ["x.py"])
    assert first is not None and json.loads(first.path.read_text())["pid"] == os.getpid()
    twice = runs.begin(tmp_path, key, None, ["x.py"])
    assert twice is not None and twice.job_id != first.job_id and twice.attempt == 0


def test_a_launcher_that_names_the_job_without_counting_is_counted_by_the_node(
        tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "MASTER_ADDR": "bert-ft-master-0",
           "RANK": "0", "WORLD_SIZE": "2"}
    found = JobIdentity.from_env(env)
    assert (found.job_id, found.source, found.attempt_known) == ("bert-ft", "pytorchjob",
                                                                False)
    run = runs.begin(tmp_path, "job:bert-ft", "bert-ft")
    assert run is not None and (run.job_id, run.attempt) == ("bert-ft", 0)
    runs.end(run, "failed")
    again = runs.begin(tmp_path, "job:bert-ft", "bert-ft")
    assert again is not None and (again.job_id, again.attempt) == ("bert-ft", 1)


@pytest.mark.parametrize(("env", "job", "attempt", "source"), [
    ({"MEGACACHE_JOB_ID": "mine", "MEGACACHE_ATTEMPT": "2"}, "mine", 2, "explicit"),
    ({"TORCHELASTIC_RUN_ID": "r-1", "TORCHELASTIC_RESTART_COUNT": "1"}, "r-1", 1,
     "torchelastic"),
    ({"TORCHELASTIC_RUN_ID": "none"}, None, 0, ""),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "3"}, "77.0", 3,
     "slurm"),
    ({"KUBERNETES_SERVICE_HOST": "h", "JOBSET_NAME": "llm", "JOBSET_RESTART_ATTEMPT": "4"},
     "llm", 4, "jobset"),
    ({"KUBERNETES_SERVICE_HOST": "h", "PET_MASTER_ADDR": "ft-node-0-0.ft"}, "ft", 0,
     "trainjob"),
    ({"KUBERNETES_SERVICE_HOST": "h", "HOSTNAME": "train-3", "JOB_COMPLETION_INDEX": "3"},
     "train", 0, "k8s-job"),
    ({"MASTER_ADDR": "bert-master-0"}, None, 0, ""),  # not on Kubernetes: no guess
])
def test_what_each_launcher_names(env: dict[str, str], job: str | None, attempt: int,
                                  source: str) -> None:
    found = JobIdentity.from_env(env)
    assert (found.job_id, found.attempt, found.source) == (job, attempt, source)


def test_a_lone_process_gets_the_command_s_job_a_worker_none(tmp_path: Path) -> None:
    """In a fresh interpreter (the identity is resolved once per process): a lone script
    is a job of its own; a spawned multiprocessing child is part of its parent's run."""
    script = ("import json, sys\n"
              "from megacache_client.job import JobIdentity\n"
              "print(json.dumps(JobIdentity.of_process(sys.argv[1])[0].job_id))\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEGACACHE_", "TORCHELASTIC_", "SLURM_", "KUBERNETES_"))}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert json.loads(out.stdout).startswith("python-"), out.stderr
    child = ("import json, multiprocessing as mp, sys\n"
             "from megacache_client.job import JobIdentity\n"
             "def look(d):\n"
             "    print(json.dumps(JobIdentity.of_process(d)[0].job_id), flush=True)\n"
             "if __name__ == '__main__':\n"
             "    p = mp.get_context('spawn').Process(target=look, args=(sys.argv[1],))\n"
             "    p.start(); p.join()\n")
    path = tmp_path / "child.py"
    path.write_text(child)
    out = subprocess.run([sys.executable, str(path), str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.stdout.strip() == "null", (out.stdout, out.stderr)


# -- where the start went ---------------------------------------------------------------------
def test_a_call_that_makes_several_process_groups_is_one_span_counting_them() -> None:
    """`DeviceMesh` and `new_subgroups` make several groups in one call: one `distributed`
    span (the outermost call's time), its count the groups made inside it
    (`_new_process_group_helper` calls), and nothing once the first step is over."""
    from megacache_client.ett import phases

    spans = phases.Phases(NOW - 10, NOW - 5)
    phases.watch(lambda: spans)
    try:
        helper = phases._timed_group_call(lambda: None, "_new_process_group_helper")
        mesh = phases._timed_group_call(lambda: [helper() for _ in range(3)], "new_group")
        mesh()
        helper()  # a group made on its own
        (imports, made, alone) = spans.spans
        assert (imports.phase, imports.seconds) == ("imports", 5.0)
        assert (made.phase, made.count, alone.count) == ("distributed", 3, 1)
        assert spans.first_step() == [imports, made, alone]
        mesh()  # after the first step: not kept
        assert len(spans.spans) == 3
    finally:
        phases.watch(phases._nobody)


def test_an_attempt_that_ended_leaves_no_lifeline_whatever_its_heartbeat_does(
        tmp_path: Path) -> None:
    """The heartbeat thread may renew while the attempt ends (SIGTERM on the main thread):
    a renewal after the end would leave a file the next attempt calls a killed one's."""
    line = Lifeline(tmp_path, "job-2", 0)
    line.renew(NOW, 3)
    assert line.path.exists()
    line.end()
    line.renew(NOW + 1, 4)  # too late
    assert not line.path.exists()
    assert Lifeline(tmp_path, "job-2", 1).orphans() == []
