"""Zero-code activation, run from `megacache_autoload.pth` at interpreter start.

Does nothing unless MEGACACHE_URL is set. It must not import torch (most Python processes
in an environment never use it, and importing it costs seconds), so it waits for torch to
be imported and then enables the client. It must never raise: a broken cache setting may
not stop a Python process from starting.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from types import ModuleType
from typing import Any

log = logging.getLogger("megacache")


def activate_from_env() -> None:
    try:
        if not os.environ.get("MEGACACHE_URL") or os.environ.get("MEGACACHE_MODE") == "off":
            return
        if "torch" in sys.modules and hasattr(sys.modules["torch"], "compile"):
            _enable()
        elif not any(isinstance(f, _TorchImportWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _TorchImportWatcher())
    except Exception as exc:  # never break interpreter start-up
        log.warning("megacache: autoload failed: %s", exc)


def _enable() -> None:
    try:
        from megacache_client.api import enable

        enable()
    except Exception as exc:
        log.warning("megacache: could not enable from environment: %s; compiling cold", exc)


class _TorchImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so we run right after `import torch`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            _enable()

        loader.exec_module = exec_module  # type: ignore[attr-defined,method-assign]
        return spec
