"""The dependency floors in pyproject.toml are versions the code really works with.

A venv pinned to the lowest allowed versions (.ci/floors.txt) runs the blob and entry tests
(both storage backends). A floor that lies shows up here, not in a user's install.
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
         f"{ROOT}[server,dev]"], capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_blobs.py", "tests/test_entries.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
