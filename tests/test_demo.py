"""The README's main job runs as documented and shows a warm start on a new machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def test_demo_shows_a_warm_start(tmp_path: Path):
    need("torch")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "demo.py"), "--steps", "2",
                           "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split("  ")[0]: line for line in proc.stdout.splitlines()}
    assert lines["megacache"].split()[1:] == ["miss", "hit"]
    assert lines["g++ builds"].split()[-1] == "0"
    assert "Compile time saved on the new machine" in proc.stdout
    assert "machine B: same job on a new machine" in proc.stderr  # progress is shown
