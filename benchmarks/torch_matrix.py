"""The client on each torch a user may bring: one venv per torch version, the demo and the
compile benchmark in each, one table.

    python -m benchmarks torch_matrix                        # 2.9.1, 2.13.0, 2.14.1
    python -m benchmarks torch_matrix --versions 2.14.1 --models mlp --write-docs
    python -m benchmarks torch_matrix --use 2.13.0=.venv/bin/python   # an existing venv

Each version gets a venv under ~/.cache/megacache-torch-matrix/venv-<version> (made once,
then reused): `pip install -e <this repo>[server] torch==<version>`, PyPI's default build
(on Linux the CUDA one, as a user would install it; several GB each). In each, the demo
(machine A cold, machine B a new machine warm from megacache) and the compile benchmark's
cold, warm-local and megacache scenarios run as they do on their own. The table compares
a new machine with a cold start and with torch's own warm restart, counts g++ builds,
checks that the new machine's losses equal the cold run's, and says when a run loaded
nothing (no speed-up is claimed for it). A benchmark, not a CI step: the versions it finds
broken get fixed or leave `SUPPORTED_TORCH` (megacache_client/torch/supported.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.record import make_record, write_record

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
VERSIONS = ("2.9.1", "2.13.0", "2.14.1")
"""The torch versions measured by default; extend with --versions."""
MODELS = ("mlp", "transformer")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
    "megacache-torch-matrix"
DEFAULT_OUT = BENCH_DIR / "results" / "torch_matrix.json"
DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- torch-matrix -->", "<!-- /torch-matrix -->"
GOAL_VS_WARM = 1.1
"""A new machine vs torch's own warm restart, on every supported version."""


def log(message: str) -> None:
    print(f"[torch_matrix {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def torch_of(python: Path) -> str | None:
    """The torch version `python` imports with megacache installed, or None."""
    try:
        run = subprocess.run([str(python), "-c", "import torch, megacache_client; "
                              "print(torch.__version__)"], capture_output=True, text=True,
                             timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def ensure_venv(version: str, use: dict[str, Path]) -> tuple[Path | None, str]:
    """The python of `version`'s venv (made and installed if need be), and what it took."""
    if version in use:
        found = torch_of(use[version])
        if found is None or not found.startswith(version):
            return None, f"{use[version]} imports torch {found}, not {version}"
        return use[version], f"existing interpreter {use[version]}"
    venv = CACHE / f"venv-{version}"
    python = venv / "bin" / "python"
    found = torch_of(python) if python.exists() else None
    if found is not None and found.startswith(version):
        return python, f"venv {venv} (reused)"
    log(f"torch {version}: making {venv} (pip install -e .[server] torch=={version})")
    started = time.monotonic()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", f"{REPO}[server]",
                          f"torch=={version}"], capture_output=True, text=True)
    if pip.returncode != 0:
        return None, f"pip install failed: {pip.stderr.strip().splitlines()[-1:]}"
    return python, f"venv {venv} (installed in {time.monotonic() - started:.0f} s)"


def run_demo(python: Path, out: Path, steps: int, timeout: float) -> dict[str, Any]:
    cmd = [str(python), str(BENCH_DIR / "demo.py"), "--steps", str(steps), "--json", str(out)]
    return _run(cmd, out, timeout)


NEW_MACHINE = "megacache+precompile"
"""compile_bench's scenario for a new machine: the client's defaults (precompiled Dynamo on
for verified entries); `--new-machine megacache` measures it with precompiled Dynamo off."""


def run_bench(python: Path, out: Path, models: Sequence[str], repeats: int, steps: int,
              timeout: float, new_machine: str = NEW_MACHINE) -> dict[str, Any]:
    cmd = [str(python), str(BENCH_DIR / "compile_bench.py"), "--models", ",".join(models),
           "--scenarios", f"cold,warm-local,{new_machine}", "--repeats", str(repeats),
           "--steps", str(steps), "--out", str(out)]
    return _run(cmd, out, timeout)


def _run(cmd: list[str], out: Path, timeout: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if not out.exists():
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {run.returncode}: {tail}"[:500]}
    result = json.loads(out.read_text())
    if run.returncode != 0:
        result["error"] = f"exit {run.returncode}"
    return result


def demo_row(version: str, demo: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"torch": version, "model": "mlp (demo)", "source": "demo"}
    if "cold" not in demo:
        return {**row, "error": demo.get("error", "no result")}
    cold, new = demo["cold"], demo["new_machine"]
    return {**row, "cold_s": cold["time_to_first_step_s"], "warm_local_s": None,
            "new_machine_s": new["time_to_first_step_s"],
            "outcome": (new.get("megacache") or {}).get("outcome"),
            "gxx_new": new.get("gxx_builds"), "losses_equal": cold["losses"] == new["losses"],
            "nothing_loaded": demo.get("nothing_loaded", "")}


def bench_rows(version: str, bench: dict[str, Any],
               new_machine: str = NEW_MACHINE) -> list[dict[str, Any]]:
    if "rows" not in bench:
        return [{"torch": version, "model": "compile_bench", "source": "compile_bench",
                 "error": bench.get("error", "no result")}]
    rows = []
    by = {(r["model"], r["scenario"]): r for r in bench["rows"]}
    for model in dict.fromkeys(r["model"] for r in bench["rows"]):
        cold, warm, new = (by.get((model, s)) or {} for s in ("cold", "warm-local",
                                                                new_machine))
        jobs = {s: [j for j in bench["jobs"] if j["model"] == model and j["scenario"] == s
                    and j.get("ok")] for s in ("cold", new_machine)}
        losses = [j["losses"] for j in jobs["cold"] + jobs[new_machine]]
        errors = [e for r in (cold, warm, new) for e in r.get("errors") or [] if e]
        rows.append({"torch": version, "model": model, "source": "compile_bench",
                     "cold_s": cold.get("ttfs_median_s"),
                     "warm_local_s": warm.get("ttfs_median_s"),
                     "new_machine_s": new.get("ttfs_median_s"),
                     "outcome": "/".join(new.get("outcomes") or []) or None,
                     "gxx_new": new.get("gxx_builds"),
                     "losses_equal": bool(losses) and all(x == losses[0] for x in losses),
                     "nothing_loaded": "; ".join(sorted(set(new.get("missed") or []))),
                     **({"error": errors[0][:300]} if errors else {})})
    return rows


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


HEADER = ("torch", "model", "cold s", "warm-local s", "new machine s", "new / warm-local",
          "new / cold", "g++ builds (new)", "megacache", "losses equal")


def cells(row: dict[str, Any]) -> list[str]:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    if row.get("error") and row.get("new_machine_s") is None:
        return [row["torch"], row["model"], "n/a", row["error"][:80]] + [""] * (len(HEADER) - 4)
    nothing = bool(row.get("nothing_loaded"))
    return [row["torch"], row["model"], num(row.get("cold_s")), num(row.get("warm_local_s")),
            num(row.get("new_machine_s")),
            "no load" if nothing else ratio(row.get("new_machine_s"), row.get("warm_local_s")),
            "no load" if nothing else ratio(row.get("new_machine_s"), row.get("cold_s")),
            "-" if row.get("gxx_new") is None else f"{row['gxx_new']:g}",
            str(row.get("outcome") or "-"), "yes" if row.get("losses_equal") else "NO"]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def notes(rows: Sequence[dict[str, Any]], versions: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for v, info in versions.items():
        out.append(f"- torch {v}: {info['torch_found'] or 'not installed'} "
                   f"({info['how']})")
    for r in rows:
        if r.get("nothing_loaded"):
            out.append(f"- torch {r['torch']} {r['model']}: the new machine loaded nothing "
                       f"({r['nothing_loaded']}); no speed-up claimed")
        elif r.get("warm_local_s") and r.get("new_machine_s"):
            x = r["new_machine_s"] / r["warm_local_s"]
            met = "met" if x <= GOAL_VS_WARM and not r.get("gxx_new") else "MISSED"
            builds = "-" if r.get("gxx_new") is None else f"{r['gxx_new']:g}"
            out.append(f"- torch {r['torch']} {r['model']}: new machine {x:.2f}x warm-local, "
                       f"{builds} g++ builds (goal <= {GOAL_VS_WARM}x, 0 builds: {met})")
        if r.get("error"):
            out.append(f"- torch {r['torch']} {r['model']}: error: {r['error']}")
    return out


def machine_of(report: dict[str, Any]) -> str:
    """The machine line of the matrix: its architecture and cores (a record's machine, or
    the string a run before the one record format wrote)."""
    m = report["machine"]
    return m if isinstance(m, str) else f"{m['os']}, {m['cores']} cores"


def write_docs(report: dict[str, Any]) -> None:
    """Replace the matrix section of docs/benchmarks.md (between its markers)."""
    text = DOCS.read_text()
    section = "\n".join([
        BEGIN, "",
        "Measured by `python -m benchmarks torch_matrix` (one venv per torch version, PyPI's "
        "default build), command:", "",
        "```bash", *[f"python -m benchmarks torch_matrix {' '.join(c)}".rstrip()
                     for c in report.get("commands", [report["argv"]])], "```", "",
        f"{report['date']}, {machine_of(report)}; medians of {report['repeats']} repeat(s) "
        f"of {report['steps']} steps; time to first step in seconds, from process start. "
        "`new machine`: empty Inductor, Triton, TMPDIR and node caches, warm from megacache "
        f"(compile_bench's `{report.get('new_machine', 'megacache')}` scenario); "
        "`warm-local`: torch's own restart on the cold run's caches; `no load`: the new "
        "machine loaded nothing, no ratio shown.", "",
        markdown(report["rows"]), "", *notes(report["rows"], report["versions"]), "", END])
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1] if END in rest else rest
        text = head + section + tail
    else:
        text += "\n" + section + "\n"
    DOCS.write_text(text)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=",".join(VERSIONS),
                        help="comma-separated torch versions (each gets a venv)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="compile benchmark models (mlp, transformer, dlrm, conv)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-demo", action="store_true", help="the compile benchmark only")
    parser.add_argument("--new-machine", default=NEW_MACHINE,
                        choices=("megacache+precompile", "megacache"),
                        help="the new machine's compile_bench scenario (default: the "
                             "client's defaults, precompiled Dynamo on)")
    parser.add_argument("--use", action="append", default=[], metavar="VERSION=PYTHON",
                        help="run VERSION with this existing interpreter instead of a venv")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of other versions from --out (a matrix run "
                             "version by version)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"replace the matrix section of {DOCS.relative_to(REPO)}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    use = {v: Path(p) for v, p in (u.split("=", 1) for u in args.use)}
    work = CACHE / "runs" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    versions: dict[str, dict[str, Any]] = {}
    for version in [v for v in args.versions.split(",") if v]:
        python, how = ensure_venv(version, use)
        versions[version] = {"python": str(python) if python else None, "how": how,
                             "torch_found": torch_of(python) if python else None}
        if python is None:
            log(f"torch {version}: skipped: {how}")
            rows.append({"torch": version, "model": "-", "error": how})
            continue
        log(f"torch {version}: {how}")
        if not args.no_demo:
            log(f"torch {version}: demo")
            rows.append(demo_row(version, run_demo(python, work / f"demo-{version}.json",
                                                   args.steps, args.timeout)))
        log(f"torch {version}: compile benchmark ({args.models})")
        rows += bench_rows(version, run_bench(python, work / f"bench-{version}.json",
                                              args.models.split(","), args.repeats,
                                              args.steps, args.timeout, args.new_machine),
                           args.new_machine)
        log(f"torch {version}: done")

    if args.merge and args.out.exists():
        earlier = json.loads(args.out.read_text())
        rows = [r for r in earlier["rows"] if r["torch"] not in versions] + rows
        versions = {**{v: i for v, i in earlier["versions"].items() if v not in versions},
                    **versions}
        rows.sort(key=lambda r: tuple(int(x) for x in r["torch"].split(".")[:3]
                                      if x.isdigit()))
        commands = [c for c in earlier.get("commands", []) if c != argv] + [argv]
    else:
        commands = [argv]
    report = make_record("torch_matrix", argv, rows, commands=commands,
                         repeats=args.repeats, steps=args.steps, versions=versions,
                         new_machine=args.new_machine, runs=str(work))
    write_record(report, args.out)
    print(markdown(rows))
    print("\n".join(notes(rows, versions)))
    if args.write_docs:
        write_docs(report)
    log(f"wrote {args.out}" + (f" and {DOCS}" if args.write_docs else ""))
    return 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
