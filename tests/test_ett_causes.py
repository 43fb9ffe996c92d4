"""Why each failure happened and where each recovery went (#60), end to end with the
default settings: one job per cause (benchmarks/ett_causes_job.py, zero-code, a real
server), each failing once and run again, against the job's own clock
(`benchmarks/ett_causes.run_case`, which also prints them as tables).

For each cause the server must name it (the attempt's `cause`, and what names it), and its
unsaved training time and time to recover must agree with the job's own clock: within
0.5 s where the failure is dated by the attempt's own end (SIGTERM, an exception, an OOM,
`sys.exit(3)`) or its lifeline on the node (SIGKILL, run again on the same node); a job
run again on another node (`lost`: SLURM's variables name it there) is dated by the last
record the killed attempt sent, so the bound grows by the time from it to the kill. The
recovery's components (`ett_components`) add up to its time to recover, and each one the
job timed itself is within the same bound of its own clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need
from helpers import ServerProcess

from benchmarks.ett_causes import CASES, TIMED, run_case

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("causes") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.mark.parametrize("case", list(CASES))
def test_one_job_per_cause_against_its_own_clock(cache: ServerProcess, tmp_path: Path,
                                                 case: str) -> None:
    need("torch", "the trainer is torch's")
    done = run_case(case, cache.url, tmp_path)
    ett, bound = done["ett"], done["bound_s"]
    a0, a1 = ett["attempts"]
    cause, word, code = CASES[case]
    assert (a0["cause"], a0["failed"], a1["cause"]) == (cause, True, None), (a0, a1)
    assert word in (a0["cause_detail"] or ""), a0
    assert a0["exit_code"] == code, a0
    row = {r["cause"]: r for r in ett["failures_by_cause"]}
    assert list(row) == [cause] and row[cause]["failures"] == 1, ett["failures_by_cause"]
    assert abs(row[cause]["unsaved_training_s"] - a0["lost_s"]) < 0.002, row
    assert abs(row[cause]["recovery_s"] - a1["time_to_recover_s"]) < 0.002, row

    problems = [f"{what}: server {server:.3f} s, the job's clock {own:.3f} s"
                for what, (server, own) in done["figures"].items()
                if abs(server - own) > bound]
    parts = done["components"]
    total = sum(server for server, _ in parts.values())
    assert abs(total - a1["time_to_recover_s"]) < 0.01, (parts, a1)
    problems += [f"{name}: server {parts[name][0]:.3f} s, the job's clock "
                 f"{parts[name][1]:.3f} s" for name in TIMED
                 if abs(parts[name][0] - parts[name][1]) > bound]
    assert done["process_groups"][0] == done["process_groups"][1], done["process_groups"]
    assert not problems, (problems, a0, a1)
