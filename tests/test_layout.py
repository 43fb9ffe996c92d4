"""The tree keeps the shape it promises: the Layout of docs/architecture.md names what is
there and only that, the client's top level stays small, and no module grows past what one
reader holds."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("megacache_client", "megacache_server")
MAX_TOP_LEVEL_MODULES = 13
MAX_MODULE_LINES = 500
MAX_README_LINES = 250
"""A README read in ten minutes: the rest is in docs/ (docs/index.md lists it)."""


def _layout_block() -> str:
    readme = (ROOT / "docs" / "architecture.md").read_text()
    section = readme[readme.index("## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def _modules(package: str) -> list[Path]:
    return [p for p in sorted((ROOT / package).rglob("*.py"))
            if p.stem not in ("__init__", "__main__")]


def test_the_layout_names_every_module_and_folder() -> None:
    words = set(re.findall(r"[A-Za-z0-9_]+", _layout_block()))
    missing = [str(p.relative_to(ROOT)) for package in PACKAGES for p in _modules(package)
               if p.stem not in words]
    folders = [str(d.relative_to(ROOT)) for package in PACKAGES
               for d in sorted((ROOT / package).rglob("*")) if d.is_dir()
               and (d / "__init__.py").exists() and d.name not in words]
    assert not missing + folders, "not named in docs/architecture.md's Layout: " + ", ".join(
        missing + folders)


def test_every_file_and_folder_the_layout_names_exists() -> None:
    names = re.findall(r"(?<![\w/])([A-Za-z0-9_.]+(?:\.py|/))", _layout_block())
    present: set[str] = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, .venv
        present |= set(files) | {d + "/" for d in dirs}
    absent = sorted({n for n in names if n not in present})
    assert not absent, f"docs/architecture.md's Layout names what is not in the tree: {absent}"


def test_the_client_top_level_stays_small() -> None:
    top = [p.name for p in sorted((ROOT / "megacache_client").iterdir())
           if (p.suffix == ".py" and p.stem != "__init__")
           or (p.is_dir() and (p / "__init__.py").exists())]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_module_is_over_500_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n}" for package in PACKAGES for p in _modules(package)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_the_readme_stays_short() -> None:
    """The front page a newcomer reads whole; the rest lives in docs/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md is {lines} lines (at most {MAX_README_LINES})"


def test_the_benchmarks_index_names_every_script() -> None:
    """benchmarks/README.md is where a newcomer finds which script answers which question:
    a script added without a line there is a script nobody finds."""
    index = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir()
                     if (p.suffix in (".py", ".sh") or (p / "__init__.py").exists())
                     and not p.name.startswith("__"))
    missing = [name for name in scripts
               if f"`{name}`" not in index and f"`{name}/`" not in index]
    assert not missing, f"not in benchmarks/README.md: {missing}"
