"""Running training jobs as fresh processes on simulated machines.

Shared by the demo, the benchmarks and the end-to-end tests. A "machine" is the local state
a real host would have: Inductor's cache dir, TMPDIR (where precompiled headers live) and
megacache's node-local blob cache. A new machine is empty directories; one given a built
toolchain (`build_toolchain`) starts as a node that has compiled before.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import TRAIN_JOB

BUILD_OUTPUT = re.compile(r" -o \S+\.(so|gch)(\s|$)")
"""g++ calls that write a kernel/probe `.so` or a precompiled header: real builds. Inductor
also preprocesses its header (`-E`) to key the `.gch` and asks `--version`; those are cheap."""


@dataclass
class Machine:
    root: Path
    toolchain: Path | None = None
    """A node that has compiled before: torch's toolchain for this host (`build_toolchain`:
    the ISA probe libraries and the precompiled header) copied in, as a node keeps them
    from its earlier jobs, when the machine is new (its Inductor dir empty). For a
    producer whose toolchain is not what a test examines: never for a machine whose g++
    count says what megacache shipped it, nor one whose first job may be stopped while
    it builds the toolchain."""

    def __post_init__(self) -> None:
        inductor = self.root / "inductor"
        new = not inductor.is_dir() or not any(inductor.iterdir())
        for sub in ("inductor", "triton", "tmp", "node"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if self.toolchain is not None and new:  # once: later runs find what it left
            for sub in TOOLCHAIN_DIRS:
                shutil.copytree(self.toolchain / sub, self.root / sub, dirs_exist_ok=True)

    def env(self) -> dict[str, str]:
        return {"TORCHINDUCTOR_CACHE_DIR": str(self.root / "inductor"),
                "TRITON_CACHE_DIR": str(self.root / "triton"),
                "TMPDIR": str(self.root / "tmp"),
                "MEGACACHE_NODE_CACHE_DIR": str(self.root / "node")}


TOOLCHAIN_DIRS = ("inductor", "tmp")
"""Where torch keeps a host's toolchain: the probe libraries in Inductor's cache dir, the
precompiled header in TMPDIR."""
PROBE_THEN_HEADER = """
import sys
import torch
from torch._inductor import cpu_vec_isa
cpu_vec_isa.pick_vec_isa()
if sys.argv[1] == "header":
    torch.compile(lambda x: torch.relu(x * 2 + 1))(torch.randn(64))
"""
"""torch's ISA probes (`probes`), then one CPU compile (`header`), which builds the
precompiled header that every CPU kernel includes."""


def build_toolchain(where: Path) -> Path:
    """Torch's CPU toolchain for this host, built once where a test session keeps it, for
    `Machine(..., toolchain=...)`: the ISA probe libraries (~4 s of g++) and the precompiled
    header (~8 s), half of a small model's cold start. Only the probes' files are kept of
    Inductor's cache dir (the compile that builds the header leaves its kernel there too)."""
    machine = Machine(where / "machine")
    for phase in ("probes", "header"):
        done = subprocess.run([sys.executable, "-c", PROBE_THEN_HEADER, phase],
                              env=clean_env() | machine.env(), capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"building torch's toolchain ({phase}) failed:\n"
                               f"{done.stderr[-3000:]}")
        if phase == "probes":
            shutil.copytree(machine.root / "inductor", where / "inductor")
    shutil.copytree(machine.root / "tmp", where / "tmp")
    shutil.rmtree(machine.root)
    return where


class GxxCounter:
    """A `g++` first on PATH that logs each call to a per-job file, then runs the real one.

    `gcc` is wrapped the same way (same log) where there is one: on a GPU, Triton builds
    the C launcher of each kernel signature with it (CPU jobs never call it).

    The wrapper must be invisible to what it counts: it runs the real compiler by its own
    name on PATH without the wrapper's dir, as an unwrapped call would. Torch keys its ISA
    probe libraries by `g++ -v`, whose `COLLECT_GCC=` line is the name the driver was run
    by: a wrapper that ran `/usr/bin/g++` gave counted processes other probe keys than
    uncounted ones, so a counted restart rebuilt the probes an uncounted cold start had
    published (the chaos run's "11 g++ builds on a fresh node")."""

    def __init__(self, bin_dir: Path) -> None:
        if shutil.which("g++") is None:
            raise RuntimeError("g++ not found: Inductor's CPU backend needs it")
        self.bin_dir = bin_dir
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in ("g++", "gcc"):
            if shutil.which(name) is None:
                continue
            wrapper = bin_dir / name
            wrapper.write_text(wrapper_script(name, bin_dir))
            wrapper.chmod(0o755)

    def env(self, log: Path) -> dict[str, str]:
        return {"PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                "GXX_LOG": str(log)}

    @staticmethod
    def builds(log: Path) -> int:
        calls = log.read_text().splitlines() if log.exists() else []
        return sum(1 for call in calls if BUILD_OUTPUT.search(call))


def wrapper_script(name: str, bin_dir: Path) -> str:
    """A shell script that logs its call to $GXX_LOG (not `--version` asks) and then runs
    `name` from PATH less `bin_dir`, so the compiler sees the argv[0] and PATH an unwrapped
    call gives it."""
    return ("#!/bin/sh\n"
            'case "$*" in *--version*|*-dumpversion*) ;; '
            '*) [ -n "$GXX_LOG" ] && echo "$*" >> "$GXX_LOG";; esac\n'
            f"ours={shlex.quote(str(bin_dir))}\n"
            'set -f; saved_ifs=$IFS; IFS=:; rest=""\n'
            'for dir in $PATH; do [ "$dir" = "$ours" ] || rest="${rest:+$rest:}$dir"; done\n'
            'IFS=$saved_ifs; PATH=$rest; export PATH; set +f\n'
            f'exec {name} "$@"\n')


FIND_PTXAS = """
import os, sys
try:
    import triton
except Exception:
    sys.exit(0)
try:
    from triton import knobs
    found = knobs.nvidia.ptxas.path
except Exception:
    found = None
bins = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for name, path in (("ptxas", found or os.path.join(bins, "ptxas")),
                   ("ptxas-blackwell", os.path.join(bins, "ptxas-blackwell"))):
    if path and os.access(path, os.X_OK):
        print(name, path)
"""
"""Prints the ptxas binaries the job's Triton runs (nothing without Triton or on ROCm)."""
PTXAS_ENV = {"ptxas": "TRITON_PTXAS_PATH", "ptxas-blackwell": "TRITON_PTXAS_BLACKWELL_PATH"}


class TritonCounter:
    """Triton compilations of a job, counted as g++ builds are: a logging `ptxas` that
    Triton runs instead of its own (TRITON_PTXAS_PATH), one call per kernel compiled for a
    CUDA GPU, whether in the trainer or in Inductor's compile workers. A kernel restored
    from a bundle (torch's Triton bundler writes its cubin into Triton's cache dir) runs no
    ptxas. `kernels` counts what Triton's own cache dir holds after the job, compiled and
    restored alike."""

    def __init__(self, bin_dir: Path, python: str = sys.executable) -> None:
        found = subprocess.run([python, "-c", FIND_PTXAS], capture_output=True, text=True,
                               timeout=120).stdout.split()
        self.env_vars: dict[str, str] = {}
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name, real in zip(found[::2], found[1::2], strict=True):
            wrapper = bin_dir / name
            wrapper.write_text(
                "#!/bin/sh\n"
                'case "$*" in *--version*) ;; '
                '*) [ -n "$PTXAS_LOG" ] && echo "$*" >> "$PTXAS_LOG";; esac\n'
                f'exec "{real}" "$@"\n')
            wrapper.chmod(0o755)
            self.env_vars[PTXAS_ENV[name]] = str(wrapper)

    @property
    def available(self) -> bool:
        return bool(self.env_vars)

    def env(self, log: Path) -> dict[str, str]:
        return {**self.env_vars, "PTXAS_LOG": str(log)} if self.env_vars else {}

    @staticmethod
    def compiles(log: Path) -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    @staticmethod
    def kernels(cache_dir: Path) -> int:
        """Kernels in a Triton cache dir: its per-kernel directories holding a binary."""
        if not cache_dir.is_dir():
            return 0
        return sum(1 for d in cache_dir.iterdir() if d.is_dir() and any(
            f.suffix in (".cubin", ".hsaco", ".zebin") for f in d.iterdir()))


@dataclass
class JobRun:
    result: dict[str, Any]
    stderr: str
    returncode: int
    gxx_builds: int | None
    wall_s: float
    triton_compiles: int | None = None
    """ptxas runs (Triton kernels compiled for a CUDA GPU); None when not counted."""
    triton_kernels: int | None = None
    """Kernels in the machine's Triton cache dir after the job (compiled or restored)."""

    @property
    def mc(self) -> dict[str, Any]:
        return dict(self.result.get("megacache", {}))

    def warnings(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("megacache:")]


KEPT = ("TORCHINDUCTOR_COMPILE_THREADS",)
"""Torch settings a job still takes from this process: how many processes compile is the
host's choice (tests/conftest.py sets 1), not a cache location."""


def clean_env() -> dict[str, str]:
    """This process's environment without megacache settings or torch cache locations."""
    drop = ("MEGACACHE_", "TORCHINDUCTOR_", "TRITON_CACHE_DIR", "TORCH_COMPILE_JOB_ID")
    return {k: v for k, v in os.environ.items() if k in KEPT or not k.startswith(drop)}


def run_job(machine: Machine, *args: str, env: dict[str, str] | None = None,
            gxx: GxxCounter | None = None, runner: list[str] | None = None,
            timeout: float = 900, triton: TritonCounter | None = None) -> JobRun:
    """Run train_job.py (or `runner` + args) on `machine` in a fresh process."""
    full_env = clean_env()
    full_env.update(machine.env())
    log = machine.root / f"gxx-{time.monotonic_ns()}.log"
    ptxas_log = log.with_name("ptxas" + log.name[3:])
    if gxx is not None:
        full_env.update(gxx.env(log))
    if triton is not None:
        full_env.update(triton.env(ptxas_log))
    full_env.update(env or {})
    cmd = (runner or [sys.executable, str(TRAIN_JOB)]) + list(args)
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return JobRun({}, f"timed out after {timeout}s: {exc}", -1, None,
                      time.monotonic() - started)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    builds = GxxCounter.builds(log) if gxx is not None else None
    counted = triton is not None and triton.available
    return JobRun(result, proc.stderr, proc.returncode, builds, time.monotonic() - started,
                  TritonCounter.compiles(ptxas_log) if counted else None,
                  TritonCounter.kernels(machine.root / "triton") if counted else None)


def nothing_loaded(result: dict[str, Any]) -> str:
    """Why a job loaded nothing torch used from megacache ("" when it did).

    A speed-up is claimed only for a run whose cache lookup gave torch something it then
    used: the outcome is a hit or a fallback *and* torch's own counters show hits (FX
    graph, AOTAutograd, or precompiled Dynamo). Anything else saved nothing, whatever the
    clock says (a second run is often faster from the OS's file cache alone)."""
    mc = result.get("megacache") or {}
    outcome = mc.get("outcome")
    if outcome not in ("hit", "fallback"):
        why = mc.get("reason") or "no reason given"
        return f"megacache {outcome or 'not used'}: {why}"
    c = result.get("counters") or {}
    hits = c.get("fxgraph_hit", 0) + c.get("aot_hit", 0) + (result.get("precompile_hit") or 0)
    if hits == 0:
        return (f"megacache {outcome}, but torch used none of the bundle (FX graph, "
                "AOTAutograd and precompiled Dynamo hits all 0)")
    return ""


def compiled_anew(result: dict[str, Any]) -> str:
    """What torch compiled itself in a run: its cache misses, as a phrase."""
    c = result.get("counters") or {}
    return (f"{c.get('fxgraph_miss', 0)} FX graph and {c.get('aot_miss', 0)} AOTAutograd "
            "cache misses")
