"""Regenerate one section of benchmarks/RESULTS.md without touching the others.

Several benchmark scripts share RESULTS.md (compile_bench.py the compile section,
server_bench.py the server section). Each owns the text between its two markers

    <!-- NAME:start -->
    ...
    <!-- NAME:end -->

and replaces only that, so one script's run never erases another's numbers. A section
that is not there yet is appended at the end of the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent.parent / "RESULTS.md"


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of section `name`."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, markdown: str) -> str:
    """`text` with section `name` replaced by `markdown` (appended if the section is absent).

    A start marker without its end marker after it is refused rather than guessed at:
    rewriting up to the end of the file could silently drop another section.
    """
    start, end = markers(name)
    body = markdown.strip("\n")
    if start in body or end in body:
        raise ValueError(f"the markdown for section {name!r} contains its own markers")
    block = f"{start}\n{body}\n{end}"
    i = text.find(start)
    if i < 0:
        if end in text:
            raise ValueError(f"{end} without {start}: fix the file by hand")
        head = text.rstrip("\n")
        return (head + "\n\n" if head else "") + block + "\n"
    j = text.find(end, i + len(start))
    if j < 0:
        raise ValueError(f"{start} without a following {end}: fix the file by hand")
    return text[:i] + block + text[j + len(end):]


@contextlib.contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """An exclusive flock on the directory, so two scripts finishing at once both land."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_section(name: str, markdown: str, path: Path = RESULTS_MD) -> None:
    """Replace section `name` of `path` with `markdown`, leaving the rest of the file alone.

    Read-modify-write under a lock on the file's directory, then an atomic rename, so a
    concurrent writer of another section is never lost and a reader never sees half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _dir_lock(path.parent):
        text = path.read_text() if path.exists() else ""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(replace_section(text, name, markdown))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
