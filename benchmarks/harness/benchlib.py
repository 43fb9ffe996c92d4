"""What every benchmark script needs and none should write again.

The scripts in benchmarks/ (compile_bench.py, server_bench.py, load_test.py, ...) each
measure something different but report it the same way: progress on stderr stamped with
the elapsed time, the machine the numbers depend on, medians and percentiles over runs,
markdown tables, a matplotlib chart when matplotlib is there, and a JSON file. They take
sizes like `64MiB` on the command line and wait for the servers they start to listen.
One copy of each of those lives here, so a fix reaches every script.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.harness import BENCH_DIR, REPO
from benchmarks.harness.servers import LOOPBACK

MiB = 1024 * 1024
SIZE_UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}

START = time.time()
"""When the benchmark started: this module is imported as the script starts."""


def log(message: str) -> None:
    """Progress on stderr, stamped with the time since the benchmark started."""
    print(f"[{time.time() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def utc_now() -> str:
    """The run's date for reports: UTC, to the second, ISO 8601."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# -- the machine -------------------------------------------------------------------------

def proc_field(path: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file (None where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return None


def package_version(dist: str) -> str | None:
    """The installed version of a Python distribution, None if it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def tool_output(*cmd: str) -> str | None:
    """First line a command prints (stdout, else stderr: `nginx -v` writes there); None if
    the tool is missing or fails to run. Runs in the repo, so `git` sees this checkout."""
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=10,
                              check=False, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (done.stdout.strip() or done.stderr.strip())
    return text.splitlines()[0] if text else None


def machine_info(packages: Mapping[str, str] | None = None,
                 tools: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, RAM, OS, Python, then the versions of
    `packages` (report key -> distribution name) and the first line of each of `tools`
    (report key -> command), then the git commit. Missing ones are None."""
    mem_kb = proc_field("/proc/meminfo", "MemTotal")
    info: dict[str, Any] = {
        "cpu": proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cores": os.cpu_count(),
        "ram_gb": round(int(mem_kb.split()[0]) / 1024**2, 1) if mem_kb else None,
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    info.update({key: package_version(dist) for key, dist in (packages or {}).items()})
    info.update({key: tool_output(*cmd) for key, cmd in (tools or {}).items()})
    info["git_commit"] = tool_output("git", "rev-parse", "--short", "HEAD")
    return info


# -- statistics --------------------------------------------------------------------------

def median(values: Iterable[float]) -> float:
    """The median, 0.0 for no values (a table cell, not an error)."""
    present = list(values)
    return float(statistics.median(present)) if present else 0.0


def median_of_present(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there (None marks a failed run); None if none is."""
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def percentile(values: Sequence[float], q: float) -> float:
    """The value below which a fraction `q` of `values` falls (nearest rank); 0.0 if empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio(value: float, reference: float, digits: int = 3) -> float | None:
    """value / reference, rounded; None where the reference measured nothing."""
    return round(value / reference, digits) if reference else None


# -- tables and reports ------------------------------------------------------------------

def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub markdown table; a `|` inside a cell becomes `/` so it cannot split the cell."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |"
              for row in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Columns padded to their widest cell, a dashed rule under the header (for stdout)."""
    cells = [list(header)] + [list(row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_num(value: float | None, fmt: str = "{:.0f}") -> str:
    """A table cell: the formatted number, or `-` where there is none."""
    return "-" if value is None else fmt.format(value)


def generated_by(script: str, argv: Sequence[str]) -> list[str]:
    """The opening lines of a RESULTS.md section: which command regenerates it (`script`
    is the benchmark's module, `compile_bench` or `compile_bench.py`)."""
    name = script.removesuffix(".py")
    return [f"Generated by `python -m benchmarks {name}` (do not edit by hand):", "",
            f"    python -m benchmarks {name} {' '.join(argv)}".rstrip(), ""]


def machine_line(m: Mapping[str, Any]) -> str:
    """The `- machine:` bullet of a RESULTS.md section, from a machine_info() dict."""
    return f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM, {m['os']}"


def image_link(alt: str, path: Path) -> str:
    """Markdown for a chart, relative to benchmarks/ where RESULTS.md lives."""
    return f"![{alt}]({os.path.relpath(path, BENCH_DIR)})"


def write_json(path: Path, data: Any, indent: int = 1) -> None:
    """`data` as JSON at `path` (parent directories created), ending in a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")


# -- charts ------------------------------------------------------------------------------

def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None (logged) without matplotlib:
    a chart is a bonus, never a reason for a benchmark run to fail."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not importable: no chart (pip install matplotlib)")
        return None
    return plt


def grouped_bars(ax: Any, groups: Sequence[str], series: Mapping[str, Sequence[float]],
                 errors: Mapping[str, Sequence[Sequence[float]]] | None = None,
                 tick_fontsize: str | None = "small") -> None:
    """One group of bars per label in `groups`, one bar per series in each; `errors` gives a
    series its [below, above] error bars. `tick_fontsize` None: matplotlib's default."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        if errors and name in errors:
            ax.bar(xs, values, width, yerr=errors[name], capsize=2, label=name)
        else:
            ax.bar(xs, values, width, label=name)
    font = {} if tick_fontsize is None else {"fontsize": tick_fontsize}
    ax.set_xticks(range(len(groups)), groups, **font)


def save_figure(plt: Any, fig: Any, path: Path, dpi: int) -> None:
    """Lay out, write (parent directories created) and close a figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# -- command line ------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """`64MiB`, `1GiB`, `512KiB` or a byte count (an argparse type)."""
    match = re.fullmatch(r"\s*(\d+)\s*(|B|KiB|MiB|GiB)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64MiB)")
    return int(match.group(1)) * SIZE_UNITS[match.group(2)]


def parse_list(convert: Callable[[str], int]) -> Callable[[str], list[int]]:
    """An argparse type for a comma-separated list of positive values, each by `convert`."""
    def parse(text: str) -> list[int]:
        values = [convert(part) for part in text.split(",") if part.strip()]
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"need positive values: {text!r}")
        return values
    return parse


# -- processes ---------------------------------------------------------------------------

def poll_until(ready: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Call `ready` until it is true (True) or `timeout` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 20) -> None:
    """Return once `proc` accepts connections on loopback `port`; RuntimeError if it exits
    first or is not listening within `timeout` s (a benchmark must not hang on a dead
    server)."""
    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.5):
            return True
        return False

    if not poll_until(listening, timeout):
        raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


@contextlib.contextmanager
def temp_root(prefix: str, keep: bool) -> Iterator[Path]:
    """A scratch directory for one run, removed afterwards unless `keep` (then logged)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
