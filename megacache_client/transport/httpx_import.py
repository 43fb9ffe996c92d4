"""Start-up hygiene: import httpx without the command-line client it imports for itself.

httpx's `__init__` imports `httpx._main` (click, rich, pygments: 40-100 ms here) whenever
those are installed, as they are beside `transformers`, only to offer `httpx` as a shell
command. A trainer never runs it, and this client is imported on the way to the first
compiled step. A `None` in `sys.modules` makes that one import fail, which httpx already
handles (its `main` becomes a stub that says the CLI is missing); the entry is removed
again at once, so a later `import httpx._main` anywhere in the process works as usual.

Importing this module does it: `megacache_client/__init__.py` imports it before anything
that imports httpx.
"""

from __future__ import annotations

import sys


def import_httpx_without_cli() -> None:
    """Import httpx (once) without `httpx._main`; a no-op when httpx is already in."""
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        return
    sys.modules["httpx._main"] = None  # type: ignore[assignment]
    try:
        import httpx  # noqa: F401
    finally:
        if sys.modules.get("httpx._main", 0) is None:
            del sys.modules["httpx._main"]


import_httpx_without_cli()
