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


def test_scale_bench_quick_writes_valid_json(tmp_path: Path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_bench.py"),
                          "--quick", "--backends", "sqlite+fs", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["backend"] == "sqlite+fs" and row["entries"] == 2000
    for route in ("exact", "fallback", "publish", "head_cas", "stats", "metrics", "dashboard"):
        assert 0 < row["latency"][route]["p50_ms"] <= row["latency"][route]["p99_ms"]
    gc = row["concurrent"]["gc"]
    assert gc["evicted"] == 200 and gc["lookups"]["n"] > 0  # 10% of 2000 entries went
    assert "would evict 200 entries" in row["gc_plan"]["last_line"]
    assert row["fsck"]["last_line"] == "clean" and row["fsck"]["max_rss_mb"] > 0
    assert row["blob_bytes_per_entry"] >= 1024 and row["index_bytes_per_entry"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "exact p50/p99" in run.stdout  # the table
