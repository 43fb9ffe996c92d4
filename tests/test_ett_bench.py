"""benchmarks/ett_bench.py --quick runs end to end and writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ett_bench_quick_writes_json_table_and_timeline(tmp_path: Path) -> None:
    out = tmp_path / "ett.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ett_bench.py"), "--quick",
                          "--backends", "sqlite+fs", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["backend"] == "sqlite+fs" and row["jobs"] == 200
    for name in ("lookup_idle", "lookup_heartbeats", "dashboard", "metrics", "heartbeats"):
        assert 0 < row[name]["p50_ms"] <= row[name]["p99_ms"], name
    assert row["heartbeats"]["n"] > 100  # 40 a second for 5 s
    timeline = row["timeline"]
    assert timeline["failures"] == 1 and 0 < timeline["ett_pct"] < 100
    assert sum(e - s for s, e, _ in timeline["timeline"]) == pytest.approx(
        sum(timeline["seconds"].values()), abs=0.05)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "lookup p99 beating ms" in run.stdout
