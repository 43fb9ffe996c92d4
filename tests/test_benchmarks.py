"""The benchmarks run and write what they promise (JSON, chart, table), in their quick modes.
They check that the scripts work, never how fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_compile_bench_quick_writes_valid_json(tmp_path: Path):
    pytest.importorskip("torch")
    out = tmp_path / "compile.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_bench.py"),
                          "--quick", "--out", str(out)], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["model"], r["scenario"]): r for r in result["summary"]}
    assert set(rows) == {("mlp", "cold"), ("mlp", "megacache")}
    for row in rows.values():
        assert row["ok"] == row["runs"] == 1
        assert row["ttfs_median_s"] > 0
    jobs = [j for j in result["jobs"] if j["scenario"] == "megacache"]
    assert jobs and jobs[0]["megacache"]["outcome"] == "hit"
    assert "megacache" in run.stdout and "cold" in run.stdout  # the table


def test_startup_bench_writes_its_table_and_json(tmp_path: Path):
    out = tmp_path / "startup.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "startup_bench.py"),
                          "--rounds", "2", "--out", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["no hook", "hook", "eager hook (before)"]
    assert all(r["runs"] == 2 and r["median_ms"] > 0 for r in result["rows"])
    assert "| hook |" in run.stdout
