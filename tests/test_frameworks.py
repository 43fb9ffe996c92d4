"""ETT for the trainers people run (#50): the Hugging Face Trainer, Accelerate and Lightning
(both of its packages), zero-code with the default settings, each killed after a checkpoint
and resumed, against a real server: the server's figures against the job's own clock
(tests/framework_job.py). The checkpoint saves and the restore come from the frameworks'
own calls (none is DCP); a slow data loader shows as data wait.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import need
from helpers import ServerProcess, ett_of
from jobs import Machine, run_job

HERE = Path(__file__).resolve().parent
DATA_S = 0.01  # per sample; 4 a batch
SETTINGS = {"STEPS": "20", "EVERY": "5", "KILL_AT": "10", "KILL_AFTER": "3",
            "DATA_S": str(DATA_S), "OMP_NUM_THREADS": "1"}
PACKAGES = {"hf": "transformers", "accelerate": "accelerate", "lightning": "lightning",
            "pytorch_lightning": "pytorch_lightning"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("frameworks") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def facts(path: Path) -> dict[int, dict[str, list[dict[str, Any]]]]:
    out: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for line in path.read_text().splitlines():
        f = json.loads(line)
        out.setdefault(f["attempt"], {}).setdefault(f["fact"], []).append(f)
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("framework", list(PACKAGES))
def test_a_framework_s_checkpoints_restore_and_data_wait_on_the_server(
        server: ServerProcess, tmp_path: Path, framework: str) -> None:
    need("torch", "the trainer is torch's")
    if importlib.util.find_spec(PACKAGES[framework]) is None:
        need(PACKAGES[framework], f"the {framework} test trains with it")
    job = f"fw-{framework.replace('_', '-')}-{int(time.time() * 1000) % 10**8}"
    truth_path, machine = tmp_path / "truth.jsonl", Machine(tmp_path / "node")
    env = {**SETTINGS, "MEGACACHE_URL": server.url, "MEGACACHE_JOB_ID": job,
           "FRAMEWORK": framework, "TRUTH": str(truth_path), "OUT": str(tmp_path / "ckpt")}
    runner = [sys.executable, str(HERE / "framework_job.py")]
    for attempt, code in ((0, -signal.SIGKILL), (1, 0)):
        run = run_job(machine, runner=runner, env={**env, "MEGACACHE_ATTEMPT": str(attempt)},
                      timeout=600)
        assert run.returncode == code, (attempt, run.stderr[-4000:])
        assert "megacache:" not in run.stderr, run.stderr[-4000:]  # no warning: hooked
    truth = facts(truth_path)
    ett = ett_of(server.url, job, attempts=2)
    a0, a1 = ett["attempts"]
    t0, t1 = truth[0], truth[1]
    saves0 = t0["save"]
    kill = t0["kill"][0]
    # the framework's own saves, each timed on the loop: as many, as long
    assert a0["checkpoint_saves"] == len(saves0), (a0, saves0)
    blocking = sum(s["blocking_s"] for s in saves0)
    assert a0["checkpoint_blocking_s"] == pytest.approx(blocking, abs=0.05 * len(saves0)
                                                        + 0.2 * blocking), (a0, saves0)
    # the restore: one, from the framework's calls
    assert a1["checkpoint_loads"] == 1 and a1["checkpoint_restore_s"] > 0, a1
    # the kill: dated by the attempt's lifeline (the restart is on the same node)
    last = saves0[-1]
    lost = kill["at"] - (last["began"] + last["blocking_s"])
    assert a0["lost_s"] == pytest.approx(lost, abs=1.0), (a0, lost)
    recover = t1["first_step"][0]["at"] - kill["at"]
    assert a1["time_to_recover_s"] == pytest.approx(recover, abs=1.0), (a1, recover)
    # the slow loader: the loop waited (at least) what the loading slept after its first
    # step
    waited = t1["end"][0]["slept"]
    assert a1["seconds"]["data_wait"] == pytest.approx(waited, rel=0.10, abs=0.03), (
        a1["seconds"], waited)
    assert sum(ett["seconds"].values()) == pytest.approx(ett["wall_s"], abs=0.01)


@pytest.mark.parametrize("version", ["1.9.0", "3.0.1", "unknown"])
def test_a_framework_outside_the_known_versions_gets_one_warning_and_no_hook(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        version: str) -> None:
    import types

    from megacache_client.torch import frameworks

    module = types.ModuleType("fakefw")
    module.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fakefw", module)
    patched: list[object] = []
    fw = frameworks.Framework("fakefw", (2, 0), (3, 0), "fakefw.trainer", patched.append)
    with caplog.at_level("WARNING", logger="megacache"):
        frameworks._patcher(fw)(types.ModuleType("fakefw.trainer"))
    assert not patched
    (record,) = caplog.records
    assert "fakefw" in record.message and ">=2.0,<3.0" in record.message
    assert "not timed" in record.message


def test_a_framework_lacking_a_known_call_gets_one_warning_and_no_hook(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from megacache_client.torch import frameworks

    module = types.ModuleType("accelerate")
    module.__version__ = "1.5.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "accelerate", module)
    defining = types.ModuleType("accelerate.accelerator")

    class Accelerator:  # a save_state but no load_state
        def save_state(self) -> None:
            return None

    defining.Accelerator = Accelerator  # type: ignore[attr-defined]
    fw = next(f for f in frameworks.FRAMEWORKS if f.package == "accelerate")
    with caplog.at_level("WARNING", logger="megacache"):
        frameworks._patcher(fw)(defining)
    assert not getattr(Accelerator.save_state, "_megacache_wrapped", False)
    (record,) = caplog.records
    assert "load_state" in record.message
