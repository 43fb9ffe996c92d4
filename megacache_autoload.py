"""Zero-code activation: `megacache_autoload.pth` runs this at every interpreter start.

With MEGACACHE_URL unset the .pth line does not even import this module. With it set, this
module only puts a finder on `sys.meta_path` and returns; the client is enabled right after
`import torch` finishes, through the same `megacache_client.enable()` an explicit caller
uses. Most Python processes of an environment (pip, DataLoader workers under spawn, helper
scripts) never import torch, and must not pay for the client's imports (httpx, pydantic,
zstandard: ~300 ms), which is why this is a top-level module and not part of the
`megacache_client` package, whose `__init__` imports them. Nothing here may raise: a bad
cache setting must never stop a Python process from starting.
"""

import os
import sys
import time

# No `from __future__ import annotations` and no `typing` at run time: each is an import that
# costs every interpreter start milliseconds; only the type checker reads these.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any


TORCH_IMPORTED = None
"""When `import torch` finished (unix seconds), once it has, zero-code."""


def activate_from_env() -> None:
    """Enable the client now if torch is already imported, else right after its import."""
    try:
        if not os.environ.get("MEGACACHE_URL"):
            return
        if os.environ.get("MEGACACHE_MODE", "").strip().lower() == "off":
            return
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "compile"):
            _enable()
        elif not any(isinstance(f, TorchImportWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, TorchImportWatcher())
    except Exception as exc:  # never break interpreter start-up
        _warn(f"megacache: autoload failed: {exc}")


def _enable() -> None:
    try:
        from megacache_client.api import enable

        enable()
    except Exception as exc:
        _warn(f"megacache: could not enable from environment: {exc}; compiling cold")


def _warn(message: str) -> None:
    import logging  # not at module level: start-up must not pay for it

    logging.getLogger("megacache").warning(message)


class TorchImportWatcher:
    """A meta-path finder that finds nothing itself: it wraps torch's own loader so the
    client is enabled as soon as `import torch` has finished executing."""

    def find_spec(self, fullname: str, path: "Any", target: "Any" = None) -> "Any":
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:  # whoever would have found torch without us
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: "ModuleType") -> None:
            global TORCH_IMPORTED
            original_exec(module)  # a failed torch import raises here: nothing to enable
            TORCH_IMPORTED = time.time()  # the end of the imports, for ETT (phases.py)
            _enable()

        loader.exec_module = exec_module
        return spec
