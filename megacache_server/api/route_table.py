"""The routes an app serves, each as (method, path), whichever way FastAPI nests them.

FastAPI up to 0.12x copies an included router's routes into the app's list; later releases
keep the router nested (`_IncludedRouter`, with its include prefix). Both the 405 answer's
`Allow` header and the route-table test (`megacache_client.wire.routes`) need the flat list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from starlette.routing import BaseRoute, Mount, Route, compile_path


def served(routes: Sequence[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(method, path, path regex) of every endpoint below `routes`; a mount is ("MOUNT",
    path). A plain Starlette route's implied HEAD is left out: the API declares its own."""
    for route in routes:
        original = getattr(route, "original_router", None)
        if original is not None:
            context = getattr(route, "include_context", None)
            yield from served(original.routes, prefix + getattr(context, "prefix", ""))
        elif isinstance(route, Mount):
            yield "MOUNT", prefix + route.path, None
        elif isinstance(route, Route) or hasattr(route, "methods"):
            path = prefix + route.path  # type: ignore[attr-defined]
            methods = set(getattr(route, "methods", None) or ())
            if type(route) is Route and "GET" in methods:
                methods.discard("HEAD")
            regex = compile_path(path)[0]
            for method in sorted(methods):
                yield method, path, regex


def allowed_methods(routes: Sequence[BaseRoute], path: str) -> list[str]:
    """Every method some route serves at `path` (what a 405 answer lists in `Allow`)."""
    return sorted({method for method, _, regex in served(routes)
                   if regex is not None and regex.match(path)})
