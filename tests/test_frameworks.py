"""ETT for the trainers people run (#50): the Hugging Face Trainer, Accelerate and Lightning
(both of its packages), zero-code with the default settings, each killed after a checkpoint
and resumed, against a real server: the server's figures against the job's own clock
(benchmarks/framework_job.py, run and read by benchmarks/frameworks_ett.py). The checkpoint
saves and the restore come from the frameworks' own calls (none is DCP); a slow data loader
shows as data wait.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need
from helpers import ServerProcess

from benchmarks import frameworks_ett


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("frameworks") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.mark.e2e
@pytest.mark.parametrize("framework", list(frameworks_ett.PACKAGES))
def test_a_framework_s_checkpoints_restore_and_data_wait_on_the_server(
        server: ServerProcess, tmp_path: Path, framework: str) -> None:
    need("torch", "the trainer is torch's")
    package = frameworks_ett.PACKAGES[framework]
    if importlib.util.find_spec(package) is None:
        need(package, f"the {framework} test trains with it")
    truth, ett, stderr = frameworks_ett.run(framework, server.url, tmp_path)
    assert not any("megacache:" in e for e in stderr), stderr  # no warning: hooked
    got = frameworks_ett.figures(truth, ett)
    # the framework's own saves, each timed on the loop: as many, as long
    n, want_n = got["checkpoint saves (attempt 0)"]
    assert n == want_n, got
    blocking, want = got["checkpoint save time (attempt 0)"]
    assert blocking == pytest.approx(want, abs=0.05 * n + 0.2 * want), got
    assert blocking >= 0.5 * want > 0, got  # the tolerance alone would let a 0 pass
    assert got["restores (attempt 1)"] == (1, 1), got  # one restore, however many calls
    assert ett["attempts"][1]["checkpoint_restore_s"] > 0
    # the kill, dated by the attempt's lifeline (restarted on the same node)
    for name in ("unsaved training time", "time to recover"):
        server_s, clock_s = got[name]
        assert server_s == pytest.approx(clock_s, abs=1.0), (name, got)
    assert got["unsaved training time"][1] > 2.0, got  # KILL_DELAY_S: beyond the tolerance
    # the slow loader: the loop waited (at least) what the loading slept after its first
    # step, within 10 %
    waited, slept = got["data wait (attempt 1)"]
    assert waited == pytest.approx(slept, rel=0.10, abs=0.03), got
    assert sum(ett["seconds"].values()) == pytest.approx(ett["wall_s"], abs=0.01)


@pytest.mark.parametrize("version", ["1.9.0", "3.0.1", "unknown"])
def test_a_framework_outside_the_known_versions_gets_one_warning_and_no_hook(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        version: str) -> None:
    import types

    from megacache_client.ett import frameworks

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

    from megacache_client.ett import frameworks

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
