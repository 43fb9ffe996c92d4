"""A test gives up on its environment in one way only: `conftest.environment_missing` (and
`need`, for a Python module). Under `CI=true` a missing part fails the run, so a CI image that
lost torch, a tool or a service cannot turn green by skipping; elsewhere the test skips and
says what is missing. The rule holds for tests written later: no other skip in tests/, and
no xfail (a test expected to fail passes whatever the code does).
And CI runs what the README tells a developer to run: `.ci/run` is the README's test command.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import environment_missing, need

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

SKIPS = {"skip", "skipif", "importorskip", "SkipTest", "skipTest", "xfail",
         "expectedFailure"}
"""Names that skip a test, or let it fail and pass (an expected failure is a skip that
also hides a fix): pytest's, unittest's, pytest.mark's."""

ALLOWED = {("conftest.py", "environment_missing"), ("test_environment.py", "outcome")}
"""(file, function) where a skip may be named: the helper, and the test's view of it."""


def outcome(give_up: Callable[[], object]) -> str:
    """What `give_up()` did to the test: "failed: why", "skipped: why" or "returned"."""
    try:
        give_up()
    except pytest.fail.Exception as exc:
        return f"failed: {exc}"
    except pytest.skip.Exception as exc:  # caught: a skip here would skip this test
        return f"skipped: {exc}"
    return "returned"


def test_a_missing_part_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch):
    for ci in ("true", "TRUE"):
        monkeypatch.setenv("CI", ci)
        assert outcome(lambda: environment_missing("redis-server", "not installed")) == \
            "failed: redis-server is required in CI but unavailable: not installed"
        assert outcome(lambda: need("megacache_no_such_module")).startswith(
            "failed: the Python module megacache_no_such_module is required in CI")
    for ci in (None, "false", ""):
        if ci is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", ci)
        assert outcome(lambda: environment_missing("redis-server", "gone")) == \
            "skipped: redis-server unavailable: gone"
        assert outcome(lambda: need("megacache_no_such_module", "for a reason")).startswith(
            "skipped: the Python module megacache_no_such_module (for a reason) unavailable")
    monkeypatch.setenv("CI", "true")
    assert need("json").dumps([]) == "[]"  # present: the module itself, whatever CI says


def skips_outside_the_helper(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each skip named in `path` outside ALLOWED."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
        found.extend((getattr(node, "lineno", 0), name) for name in names
                     if name in SKIPS and (path.name, function) not in ALLOWED)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text(), str(path)), "")
    return sorted(found)


def test_no_test_skips_but_through_the_helper():
    found = [f"{path.relative_to(TESTS)}:{line} {name}"
             for path in sorted(TESTS.rglob("*.py")) if "__pycache__" not in path.parts
             for line, name in skips_outside_the_helper(path)]
    assert not found, ("no xfail; skip through conftest.environment_missing(what, why) or "
                       "conftest.need(module), which fail under CI=true: " + ", ".join(found))


def test_the_skip_rule_sees_the_usual_spellings(tmp_path: Path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import pytest\n"
                      "from unittest import SkipTest\n"
                      "torch = pytest.importorskip('torch')\n"
                      "@pytest.mark.skipif(True, reason='x')\n"
                      "def test_a():\n"
                      "    pytest.skip('no GPU')\n"
                      "@pytest.mark.xfail(reason='flaky')\n"
                      "def test_b():\n"
                      "    pytest.xfail('not yet')\n"
                      "from unittest import expectedFailure\n")
    assert skips_outside_the_helper(sample) == [(2, "SkipTest"), (3, "importorskip"),
                                                (4, "skipif"), (6, "skip"), (7, "xfail"),
                                                (9, "xfail"), (10, "expectedFailure")]


def test_ci_runs_exactly_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^\*\*Run the tests\*\*.*?^```bash\n(.*?)^```", readme, re.S | re.M)
    assert block, "the README has no ```bash block under **Run the tests**"
    [command] = block.group(1).splitlines()
    ci = ROOT / ".ci" / "run"
    steps = [line.split("  #")[0] for line in ci.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    # the README's command and nothing else, in the repository, failing on a missing part
    assert steps == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "export CI=true",
                     command], steps
    assert os.access(ci, os.X_OK), f"{ci} is not executable"
    # the Tests section's "everything" line is the same pytest run
    run_tests = command.rsplit(" && ", 1)[-1]
    assert re.search(rf"^{re.escape(run_tests)} +# everything: what \.ci/run runs$", readme,
                     re.M), f"README, Tests: no '{run_tests}  # everything: what .ci/run runs'"
    # on xdist workers, a file's module-scoped servers stay in one worker
    assert " -n " not in run_tests or run_tests.endswith(" --dist loadfile"), run_tests


def test_a_hang_the_timeout_cannot_break_ends_with_every_threads_stack(tmp_path: Path):
    """A test stuck where SIGALRM never reaches it (here: the signal blocked, as in C code
    holding a lock) is ended by conftest's watchdog past the limit, naming where it hung,
    instead of holding the run until CI's own limit (a stop once waited 65 min for one)."""
    import subprocess
    import sys
    import time

    tests = Path(__file__).resolve().parent
    (tmp_path / "test_stuck.py").write_text(
        "import signal, time\n"
        "def test_stuck_where_no_alarm_reaches():\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "    time.sleep(120)\n")
    env = {**os.environ, "MEGACACHE_TEST_HANG_MARGIN_S": "1", "PYTHONPATH": str(tests)}
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
         "-o", "timeout=1", "-o", "addopts=", "--rootdir", str(tmp_path),
         str(tmp_path / "test_stuck.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    took = time.monotonic() - started
    assert run.returncode != 0
    assert took < 60, f"the watchdog did not end the hang ({took:.0f} s)"
    assert "Timeout" in run.stderr and "test_stuck_where_no_alarm_reaches" in run.stderr, \
        run.stderr[-2000:]


def test_the_workers_take_the_longest_files_first(pytestconfig: pytest.Config):
    """The record of each file's seconds names files that exist, and the collection (what
    `--dist loadfile` hands out, in order, with xdist's reorder off: conftest's
    `pytest_configure`) starts with the file it says is longest and keeps each file's tests
    together; xdist's own reorder is off."""
    import json
    import subprocess
    import sys

    seconds = json.loads((TESTS / "file_seconds.json").read_text())
    assert seconds and all((TESTS / name).is_file() for name in seconds), \
        [name for name in seconds if not (TESTS / name).is_file()]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    files = [line.split("::")[0].rsplit("/", 1)[-1] for line in listed.splitlines()
             if "::" in line]
    runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert runs[0] == max(seconds, key=seconds.get)
    assert len(runs) == len(set(runs)), "a file's tests are split"
    assert getattr(pytestconfig.option, "loadscopereorder", False) is False


def test_the_file_seconds_record_is_refreshed_from_a_run_s_junit(tmp_path: Path) -> None:
    """`tests/file_seconds.py` (the refresh CONTRIBUTING names) sums each file's testcases,
    classes and parametrised cases included, and writes JSON conftest can read."""
    import json

    from file_seconds import file_seconds, render

    junit = tmp_path / "run.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="1.4"/>'
        '<testcase classname="tests.test_a.TestX" name="t2[x]" time="2.4"/>'
        '<testcase classname="tests.test_b" name="t3" time="9.0"/>'
        '<testcase classname="" name="collect error" time="3"/>'
        '</testsuite></testsuites>')
    seconds = file_seconds(junit)
    assert list(seconds.items()) == [("test_b.py", 9), ("test_a.py", 4)]
    assert json.loads(render(seconds)) == seconds
