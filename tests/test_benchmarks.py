"""The benchmarks run and write what they promise (JSON, chart, table), in their quick modes.
They check that the scripts work, never how fast anything is."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from conftest import ensure_tools, need

from benchmarks.harness.record import FIELDS, make_record, write_record

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def assert_chart(path: Path, figsize: tuple[float, float], dpi: int) -> None:
    """`path` is a PNG of the benchmark's figure (`figsize` inches at `dpi`, as its chart
    function makes it) that shows something: more than one colour, not a blank canvas."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()  # decodes every pixel: a truncated or corrupt file fails here
        assert image.format == "PNG", image.format
        assert image.size == (round(figsize[0] * dpi), round(figsize[1] * dpi)), image.size
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 1, f"{path} is blank"


def benchmark_modules() -> list[str]:
    """The benchmarks as the file system has them: benchmarks/*.py but the package's own."""
    return sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                  if not p.name.startswith("__"))


def test_the_runner_lists_every_benchmark_with_what_it_answers() -> None:
    """`python -m benchmarks --list` names each module of benchmarks/ once, with the opening
    of its docstring; each has the `main(argv)` the runner calls; no helper of the harness
    is listed."""
    run = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    listed = dict(line.split(None, 1) for line in run.stdout.splitlines())
    assert sorted(listed) == benchmark_modules()
    assert {"compile_bench", "server_bench", "nightly"} <= set(listed)
    assert not set(listed) & {"machines", "servers", "models", "benchlib", "train_job"}
    for name, what in listed.items():
        assert what.strip() and "(no docstring)" not in what, name
        tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
        main = next((f for f in tree.body if isinstance(f, ast.FunctionDef)
                     and f.name == "main"), None)
        assert main is not None and len(main.args.args) == 1, f"{name}: no main(argv)"
        assert main.args.defaults, f"{name}: main(argv) needs argv=None (run as a script)"
    assert "[--quick --write-results]" in listed["compile_bench"]


def test_the_runner_refuses_a_name_that_is_no_benchmark() -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks", "machines"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no benchmark 'machines'" in run.stderr, run.stderr
    assert "compile_bench" in run.stderr  # the names it would take


def test_the_nightly_command_runs_the_nightly_tier_and_only_it() -> None:
    """`python -m benchmarks nightly` (the command docs/benchmarks.md gives) selects the
    tests marked nightly, which every plain pytest run leaves out; pytest's own options
    pass through (here: collect, do not run)."""
    run = subprocess.run([sys.executable, "-m", "benchmarks", "nightly", "--collect-only",
                          "tests/test_demo.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)  # a light file (the corpus's imports transformers)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert collected and all(c.split("[")[0].endswith("_nightly") for c in collected), \
        collected
    plain = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                            "tests/test_demo.py"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert not set(collected) & set(plain.stdout.splitlines())  # left out of a plain run


def test_a_quick_benchmark_runs_through_the_runner_and_writes_the_one_record(
        tmp_path: Path) -> None:
    """`python -m benchmarks NAME --quick` passes the benchmark its own options and the
    JSON it writes opens with the record's fields, filled."""
    need("torch")
    out = tmp_path / "dataloader.json"
    argv = ["--quick", "--out", str(out)]
    run = subprocess.run([sys.executable, "-m", "benchmarks", "dataloader_bench", *argv],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert list(record)[:len(FIELDS)] == list(FIELDS)
    assert record["benchmark"] == "dataloader_bench" and record["argv"] == argv
    assert datetime.fromisoformat(record["date"]).tzinfo is not None
    assert record["machine"]["cores"] > 0 and record["machine"]["git_commit"]
    import torch

    assert record["torch"] == torch.__version__
    assert record["goals"] == []
    ways = {row["way"]: row for row in record["rows"]}
    assert len(ways) == 3 and all(row["ns_per_batch"] > 0 for row in ways.values()), ways
    assert "runs_ns" in record  # the benchmark's own field, after the common ones


def test_the_record_keeps_its_own_fields_its_own(tmp_path: Path) -> None:
    """A benchmark's field may not shadow a common one, and what is written is a record."""
    record = make_record("x_bench", ["--quick"], [{"a": 1}], goals=["g"], machine={"m": 1},
                         extra=2)
    assert record["benchmark"] == "x_bench" and record["extra"] == 2
    assert record["machine"] == {"m": 1} and record["goals"] == ["g"]
    with pytest.raises(ValueError, match="torch"):
        make_record("x_bench", [], [], torch="2.0")
    with pytest.raises(ValueError, match="missing"):
        write_record({"benchmark": "x_bench", "rows": []}, tmp_path / "x.json")
    assert write_record(record, tmp_path / "x.json") == tmp_path / "x.json"
    assert json.loads((tmp_path / "x.json").read_text()) == record


def test_every_benchmark_writes_json_through_the_one_helper() -> None:
    """A benchmark that writes its results file by hand would bring back the many
    formats: each module that writes JSON does it with write_record."""
    by_hand = []
    for name in benchmark_modules():
        source = (ROOT / "benchmarks" / f"{name}.py").read_text()
        if re.search(r"write_json\(|\bout\b\S*\.write_text\(json\.dumps", source):
            by_hand.append(name)  # its results file (`--out`), by hand
    assert not by_hand, f"write a record with benchmarks.harness.record: {by_hand}"


def test_the_harness_is_one_way_and_edits_no_path() -> None:
    """The tests use the benchmarks' harness, never the other way round: nothing under
    benchmarks/ imports a module of tests/, and neither side puts a directory on sys.path
    (the harness is the package `benchmarks.harness`)."""
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests"}
    found = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level \
                else []
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                      if n.split(".")[0] in test_modules]
    for path in [*(ROOT / "benchmarks").rglob("*.py"), ROOT / "tests" / "conftest.py"]:
        if "sys.path.insert" in path.read_text() or "sys.path.append" in path.read_text():
            found.append(f"{path.relative_to(ROOT)} edits sys.path")
    assert not found, found


def test_compile_bench_quick_writes_valid_json(tmp_path: Path):
    need("torch")
    out = tmp_path / "compile.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_bench.py"),
                          "--quick", "--out", str(out)], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["model"], r["scenario"]): r for r in result["rows"]}
    assert set(rows) == {("mlp", "cold"), ("mlp", "megacache")}
    for row in rows.values():
        assert row["ok"] == row["runs"] == 1
        assert row["ttfs_median_s"] > 0
    jobs = [j for j in result["jobs"] if j["scenario"] == "megacache"]
    assert jobs and jobs[0]["megacache"]["outcome"] == "hit"
    assert "megacache" in run.stdout and "cold" in run.stdout  # the table


def test_server_bench_quick_writes_tables_json_and_chart(tmp_path: Path):
    """The split server benchmark still composes: every job runs against every target and
    the report has the shape RESULTS.md is rendered from (nginx and wrk are the references:
    installed with apt when missing, as CI runs as root)."""
    ensure_tools({"nginx": "nginx", "wrk": "wrk"})
    out = tmp_path / "server.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "server_bench.py"),
                          "--quick", "--no-redis", "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["size_mib"], r["readers"]) for r in report["rows"]["get"]] == [(1, 1), (1, 16)]
    for row in report["rows"]["get"] + report["rows"]["put"]:
        for target in ("ours", "nginx"):
            assert row[target]["errors"] == 0 and row[target]["mb_s"] > 0
            assert len(row[target]["runs"]) == 1
    assert {r["target"] for r in report["rows"]["lookup"]} == {"ours", "healthz", "nginx"}
    assert all(r["errors"] == 0 and r["requests_s"] > 0 for r in report["rows"]["lookup"])
    assert report["machine"]["git_commit"] and report["manifest_bytes"] > 0
    assert [g["met"] for g in report["goals"]][0] is None  # 64 MiB x16 is not in --quick
    assert_chart(out.with_suffix(".png"), (15, 4.8), dpi=110)  # serverbench/report.py
    assert "| ours GET /v1/ac/{key} | 32 |" in run.stdout  # the lookup table on stdout


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
    # the server's own histogram saw the lookup process's lookups (and the ones before GC)
    seen, sent = gc["server_exact"], gc["client_exact"]
    assert seen["count"] >= gc["lookups"]["n"] > 0
    # every lookup the load process timed (and its first, untimed one), no other
    assert 0 < sent["count"] <= seen["count"] <= sent["count"] + 1, (seen, sent)
    # the server times a part of each round trip the client timed: never more of them slow
    assert seen["over_50ms"] <= sent["over_50ms"], (seen, sent)
    assert "would evict 200 entries" in row["gc_plan"]["last_line"]
    assert row["fsck"]["last_line"] == "clean" and row["fsck"]["max_rss_mb"] > 0
    assert row["blob_bytes_per_entry"] >= 1024 and row["index_bytes_per_entry"] > 0
    assert_chart(out.with_suffix(".png"), (13, 5), dpi=110)  # scale_bench.chart
    assert "exact p50/p99" in run.stdout  # the table


def test_fleet_bench_quick_agrees_and_uploads_once(tmp_path: Path):
    """N = 2, 4 nodes of 2 ranks, proxied and redirected: the JSON has every run, every
    job's ranks got one resolution, and each cold fleet uploaded the bundle once."""
    need("torch")
    out = tmp_path / "fleet.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fleet_bench.py"),
                          "--quick", "--out", str(out)], capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["nodes"], r["redirect"], r["cold"]): r for r in result["rows"]}
    assert set(rows) == {(n, redirect, cold) for n in (2, 4) for redirect in (False, True)
                         for cold in (False, True)}
    for row in rows.values():
        assert row["error_count"] == 0 and row["distinct_resolutions"] == 1, row
        assert row["lookups_per_node"] > 0 and 0 < row["p50_s"] <= row["p99_s"]
    for (_, redirect, cold), row in rows.items():
        if cold:
            assert row["uploads"] == 1 and row["outcomes"] == ["miss"], row
        else:
            assert row["outcomes"] == ["hit"] and row["republished"]["new_etag"], row
            carried = row["store_bytes_per_node" if redirect else "replica_bytes_per_node"]
            assert carried > 0, row
            assert row["replica_share"] < 0.01 if redirect else row["replica_share"] == 1.0
    assert [g["met"] for g in result["goals"]][:3] == [True, True, True]
    assert_chart(out.with_suffix(".png"), (11, 4), dpi=110)  # fleet_bench.chart
    assert "replica MB/node" in run.stdout  # the table


def test_scrub_bench_quick_measures_both_phases(tmp_path: Path):
    out = tmp_path / "scrub.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scrub_bench.py"),
                          "--quick", "--out", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["scrub"]: r for r in result["rows"]}
    assert set(rows) == {"off", "on"}
    for row in rows.values():
        assert row["lookups"] == 200 and 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert all(v is not None for v in row["oldest_unverified_s"]), row
    assert result["p99_ratio"] > 0 and "p99 with the scrub on / off" in run.stdout


def _job(scenario: str, ttfs: float, outcome: str | None, fx_hit: int) -> dict:
    """One job record as compile_bench keeps it (train_job.py's result, ok)."""
    job = {"model": "mlp", "scenario": scenario, "repeat": 1, "ok": True, "wall_s": ttfs,
           "gxx_builds": 0 if fx_hit else 9, "time_to_first_step_s": ttfs,
           "first_step_s": 1.0, "steady_step_s": 0.01, "compile_s": 1.0, "precompile_hit": 0,
           "counters": {"fxgraph_hit": fx_hit, "fxgraph_miss": 0 if fx_hit else 3,
                        "aot_hit": fx_hit, "aot_miss": 0 if fx_hit else 3}}
    if outcome is not None:
        job["megacache"] = {"outcome": outcome, "reason": "no entry for model 'mlp' yet",
                            "bytes_down": 0, "tts": {}}
    return job


def test_compile_bench_claims_no_ratio_for_a_run_that_loaded_nothing():
    """A megacache job that missed (faster than cold anyway: a warm OS file cache) gets no
    ratio, a note saying what was missed and why, and a missed goal."""
    from benchmarks import compile_bench

    jobs = [_job("cold", 20.0, None, 0), _job("warm-local", 5.0, None, 2),
            _job("megacache", 15.0, "miss", 0)]
    rows = compile_bench.summarize(jobs, ["mlp"], ["cold", "warm-local", "megacache"])
    mega = next(r for r in rows if r["scenario"] == "megacache")
    assert mega["vs_cold"] is None and mega["vs_warm-local"] is None
    assert mega["missed"] == ["megacache miss: no entry for model 'mlp' yet"]
    text = compile_bench.render_text(rows)
    assert "no load" in next(line for line in text.splitlines() if "megacache" in line)
    assert compile_bench.missed_lines(rows) == [
        "mlp megacache: 1 of 1 runs loaded nothing, no speed-up claimed for them (megacache "
        "miss: no entry for model 'mlp' yet)"]
    # a hit torch used none of is no load either; a real hit keeps its ratios
    inert = _job("megacache", 15.0, "hit", 0)
    assert compile_bench.missed("megacache", inert).startswith("megacache hit, but torch used")
    rows = compile_bench.summarize([*jobs[:2], _job("megacache", 5.0, "hit", 2)], ["mlp"],
                                   ["cold", "warm-local", "megacache"])
    assert next(r for r in rows if r["scenario"] == "megacache")["vs_cold"] == 0.25


def test_recovery_bench_reads_a_killed_job_s_own_clock() -> None:
    """The job's figures by its own clock, on a hand-made two-attempt time line: started at
    0, first step at 10, saves ending at 20 and 30 (1 s each), killed at 34; restarted, its
    first step at 44, a save ending at 60 (1 s), the end at 70."""
    from benchmarks import recovery_bench

    def facts(*rows: tuple[str, float, dict[str, float]]) -> list[dict[str, float | str]]:
        return [{"fact": name, "at": at, **extra} for name, at, extra in rows]

    attempts = [
        {"gxx": 14, "facts": facts(("started", 0.5, {"at0": 0.0}), ("first_step", 10, {}),
                                   ("save", 20, {"blocking_s": 1.0}),
                                   ("save", 30, {"blocking_s": 1.0}), ("kill", 34, {}))},
        {"gxx": 0, "facts": facts(("started", 34.5, {"at0": 34.4}), ("first_step", 44, {}),
                                  ("save", 60, {"blocking_s": 1.0}), ("end", 70, {}))}]
    got = recovery_bench.clock(attempts)
    assert got["time_to_start_s"] == 10 and got["time_to_recover_s"] == [10]
    assert got["unsaved_training_s"] == 4 and got["checkpoint_save_s"] == 3
    assert got["training_s"] == (30 - 10 - 2) + (70 - 44 - 1)
    assert got["wall_s"] == 70 and got["gxx_per_restart"] == [0]
    assert got["ett_pct"] == pytest.approx(100 * 43 / 70)


def test_budget_bench_splits_a_start_and_rates_it_against_eager() -> None:
    """Hand-made jobs of a zero-code script (harness/corpus_job.py's marks, no client call):
    the parts come from the marks, the ratios from the medians, rows nobody has are left
    out, and a new machine's g++ builds are reported (the worst of its runs)."""
    from benchmarks import budget_bench

    def job(kind: str, repeat: int, step1: float, wall: float, gxx: int) -> dict:
        marks = {"torch_imported_s": 2.0, "built_s": 3.0, "optimizer_s": 3.0,
                 "compile_called_s": 3.0 if kind == "eager" else 4.0,
                 "first_step_end_s": step1}
        return {"model": "bert", "kind": kind, "repeat": repeat, "ok": True, "marks": marks,
                "time_to_first_step_s": step1, "first_step_s": step1 - marks["compile_called_s"],
                "wall_s": wall, "gxx_builds": gxx}

    jobs = [job("eager", 1, 4.0, 5.0, 0), job("new", 1, 8.0, 9.0, 0),
            job("cold", 1, 40.0, 42.0, 30), job("eager", 2, 4.0, 5.0, 0),
            job("new", 2, 6.0, 7.0, 1), job("cold", 2, 36.0, 38.0, 30),
            {**job("new", 3, 1.0, 1.0, 0), "ok": False}]  # a failed run counts for nothing
    row, = budget_bench.summarize(jobs, ["bert"])
    assert row["parts"]["new"]["build model"] == 1.0  # built_s - torch_imported_s
    assert row["parts"]["new"]["to end of step 1"] == 7.0 and row["new_vs_eager_step1"] == 1.75
    assert row["new_vs_eager_process"] == 1.6
    assert row["overhead_removed"] == pytest.approx((38 - 7) / (38 - 4), abs=1e-3)
    assert row["new_gxx_builds"] == 1
    text = budget_bench.render([row])
    assert "| build model | 1.00 | 1.00 | 1.00 |" in text
    assert "client enable" not in text  # no job has it: no row of dashes
    assert "g++ builds on a new machine 1" in text


def test_the_corpus_job_trains_eager_as_the_floor(tmp_path: Path) -> None:
    """`harness/corpus_job.py NAME STEPS --eager` (budget_bench --hf's floor) trains without
    torch.compile: nothing compiled, and the time to the end of step 1 is reported."""
    need("torch", "the corpus job trains a torch model")
    need("transformers", "the corpus is transformers models")
    from benchmarks.harness import CORPUS_JOB
    from benchmarks.harness.machines import Machine, run_job

    run = run_job(Machine(tmp_path), str(CORPUS_JOB), "vit", "2",
                  "--eager", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                  runner=[sys.executable], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.result["losses"]) == 2
    assert run.result["fxgraph_miss"] == run.result["fxgraph_hit"] == run.result["aot_miss"] == 0
    marks = run.result["marks"]
    assert 0 < marks["torch_imported_s"] <= marks["compile_called_s"] \
        <= run.result["time_to_first_step_s"] == marks["first_step_end_s"]
