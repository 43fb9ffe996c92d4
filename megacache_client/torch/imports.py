"""Patch a module when the trainer imports it, never import it ourselves.

The client times checkpoints of `torch.distributed.checkpoint` and of the frameworks people
train with (`frameworks.py`). It must not import any of them: a framework the trainer does
not use costs nothing (no import time, no side effects), and one imported later is patched
as soon as it has executed. `when_imported(name, patch)` runs `patch(module)` at once if the
module is there, else right after its import, through a meta-path finder that finds
nothing itself: it wraps the loader of the module whoever would have found it returns.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger("megacache")

Patch = Callable[[ModuleType], None]

_lock = threading.Lock()
_waiting: dict[str, list[Patch]] = {}


def when_imported(name: str, patch: Patch) -> None:
    """`patch(module)` now if `name` is imported, else once its import has executed."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None \
            and not _initialising(module):
        _run(patch, module)
        return
    with _lock:
        _waiting.setdefault(name, []).append(patch)
        if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())


def _initialising(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _run(patch: Patch, module: ModuleType) -> None:
    try:
        patch(module)
    except Exception as exc:  # the trainer's module is theirs; our timing only ours
        log.debug("megacache: %s not patched: %s: %s", module.__name__, type(exc).__name__,
                  exc)


class _AfterImport:
    """A meta-path finder that finds nothing itself: for a module someone waits for, it
    wraps the loader whoever would have found it returns, to patch the module once it
    has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _waiting:
            return None
        spec = None
        for finder in list(sys.meta_path):  # whoever would have found it without us
            if isinstance(finder, _AfterImport):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            with _lock:
                patches = _waiting.pop(fullname, [])
            for patch in patches:
                _run(patch, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
