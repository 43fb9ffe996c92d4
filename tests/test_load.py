"""A short run of the load test: concurrent mixed traffic, zero errors, no write lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_short_load_run_loses_nothing(tmp_path: Path):
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_test.py"),
                          "--clients", "30", "--seconds", "5", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == 0, result["error_kinds"]
    assert result["writes_acknowledged"] > 0
    assert result["writes_lost_or_corrupt"] == []
    assert set(result["by_op"]) == {"lookup", "download", "publish"}
