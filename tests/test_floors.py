"""The dependency floors in pyproject.toml are versions the code really works with.

A venv pinned to the lowest allowed versions (.ci/floors.txt) runs the blob and entry tests
(both storage backends). A floor that lies shows up here, not in a user's install. The venv
holds the server ([server,s3]) and pytest only: the test services' programs (redis-server,
weed) are this venv's, found on PATH, which keeps it ~0.3 GB instead of the [dev] extra's 1 GB.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ROOT / ".ci" / "floors.txt"


def test_server_tests_pass_at_the_dependency_floors(tmp_path: Path):
    venv = tmp_path / "floors"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "-c", str(FLOORS), "-e",
         f"{ROOT}[server,s3]", "pytest", "pytest-timeout"],
        capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "run"), "tests/test_blobs.py", "tests/test_entries.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
