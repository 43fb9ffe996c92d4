"""Refresh tests/file_seconds.json from a run's junit XML: the seconds each test file took,
the order the workers take files in (`conftest.pytest_collection_modifyitems`).

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/run.xml
    .venv/bin/python tests/file_seconds.py /tmp/run.xml

Only the files the run holds are written (a file of a partial run keeps no stale figure);
seconds are whole, the longest first.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

RECORD = Path(__file__).with_name("file_seconds.json")
"""Seconds each test file took in a CI-like run (the per-file sums of `--junitxml`): the
order the workers take files in. Stale figures cost only balance, never a result."""


def recorded() -> dict[str, float]:
    """The record as conftest sorts by it ({} when there is none)."""
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {}


def file_seconds(junit: Path) -> dict[str, int]:
    """{test file name: seconds of its testcases}, the longest first."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((part for part in module if part.startswith("test_")), None)
        if name is not None:
            seconds[f"{name}.py"] += float(case.get("time") or 0.0)
    return dict(sorted(((f, round(s)) for f, s in seconds.items()), key=lambda fs: -fs[1]))


def render(seconds: dict[str, int]) -> str:
    """The record's text: one file per line, so a refresh diffs by file."""
    lines = ",\n".join(f"{json.dumps(name)}: {s}" for name, s in seconds.items())
    return "{\n" + lines + "\n}\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/file_seconds.py RUN.xml")
    RECORD.write_text(render(file_seconds(Path(sys.argv[1]))))
    print(f"wrote {RECORD}")
