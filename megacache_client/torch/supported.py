"""Which torch the client works with, stated once, and the check that enforces it.

`SUPPORTED_TORCH` is the range the client is measured on (`benchmarks/torch_matrix.py`):
2.9.1, 2.13.0 and 2.14.1 work; 2.5.1 does not (no `torch.compiler.config`, no caching
precompile, another Mega-Cache format). pyproject.toml (`[tool.megacache]`), the README and
docs/configuration.md repeat it, and a test keeps them equal to this constant.

Outside the range the client is inert: `enable()` returns a session that does nothing (no
lookup, no download, no publish, no event: no network traffic at all) after one warning
naming the torch found and the range; torch compiles as it would without the client.
Inside it, a torch that lacks one of the APIs the client calls (a patched or partial build)
is met the same way, with a message naming the missing API instead of a traceback.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

log = logging.getLogger("megacache")

SUPPORTED_TORCH = ">=2.9,<2.15"
"""The torch versions the client runs with (a PEP 440 specifier; release numbers only)."""
LOWEST = (2, 9)
BELOW = (2, 15)
"""`SUPPORTED_TORCH` as tuples: the lowest supported (major, minor), the first one not."""

REQUIRED_APIS = ("compiler.config", "compiler.save_cache_artifacts",
                 "compiler.load_cache_artifacts", "backends.cpu.get_cpu_capability")
"""Attributes of `torch` the client calls on every run; found without importing Dynamo."""

_warned = threading.Event()


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string (`2.13.0+cpu`, `2.15.0.dev20260101`), or
    None if it does not start with two numbers."""
    found = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def in_range(version: str) -> bool:
    found = release(version)
    return found is not None and LOWEST <= found < BELOW


def missing_apis(torch: Any) -> list[str]:
    """The `REQUIRED_APIS` this torch lacks, as `torch.<path>`."""
    missing = []
    for path in REQUIRED_APIS:
        obj = torch
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"torch.{path}")
                break
    return missing


def problem(torch: Any | None = None) -> str:
    """Why the client cannot work with this process's torch ("" when it can)."""
    if torch is None:
        try:
            import torch as imported
        except Exception as exc:  # no torch, or one that fails to import
            return f"torch cannot be imported ({type(exc).__name__}: {exc}); megacache " \
                f"needs torch {SUPPORTED_TORCH}"
        torch = imported
    version = str(getattr(torch, "__version__", "unknown"))
    if not in_range(version):
        return (f"torch {version} is outside the range megacache supports "
                f"(torch{SUPPORTED_TORCH})")
    missing = missing_apis(torch)
    if missing:
        return (f"torch {version} lacks {', '.join(missing)}, which megacache needs "
                f"(a partial or patched torch build?)")
    return ""


def warn_once(reason: str) -> None:
    """The one warning a process gets about its torch (enable() may run twice: zero-code
    hook, then an explicit call)."""
    if _warned.is_set():
        log.info("megacache: %s", reason)
        return
    _warned.set()
    log.warning("megacache: %s; the cache is off for this process (inert): torch compiles "
                "as usual", reason)


def explain_api_error(exc: BaseException) -> str:
    """A clear sentence for an AttributeError torch raised at the client (an API this torch
    lacks), naming the torch version and the supported range."""
    try:
        import torch

        version = str(torch.__version__)
    except Exception:
        version = "unknown"
    return (f"torch {version} lacks an API megacache uses ({exc}); megacache supports "
            f"torch{SUPPORTED_TORCH}")
