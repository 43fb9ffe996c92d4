"""The torch.compile hook: the first compile of a process loads the cache first.

torch.compile is lazy (it compiles on the first call of the returned module), so loading
when torch.compile is *called* is early enough, and that call tells us what the fingerprint
needs: what is compiled (a module, `module._call_impl` from `nn.Module.compile()`, a
function) and the compile options. Each distinct fingerprint is loaded once, so a process
that compiles a model and its loss loads both entries. `torch.compile(fullgraph=True)` with
no model returns a decorator that calls torch.compile again with the function: only that
second call is a compile. The hook is installed once; only the active session sees calls.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Protocol

log = logging.getLogger("megacache")

class CompileObserver(Protocol):
    """What the hook needs of a session (`lifecycle.Session` is one): told before and
    after each compile, and asked whether a precompiled package torch could not install
    may be dropped. A protocol, so this layer never imports the lifecycle above it."""

    def before_compile(self, target: Any, options: dict[str, Any]) -> None: ...

    def after_compile(self, compiled: Any) -> Any: ...

    def drop_precompiled(self, target: Any, exc: Exception) -> bool: ...


_lock = threading.Lock()
_original: Any = None
_active: CompileObserver | None = None


def install(session: CompileObserver) -> None:
    """Route torch.compile calls through `session` (replacing any earlier session)."""
    global _original, _active
    import torch

    with _lock:
        _active = session
        if _original is None:
            _original = torch.compile
            torch.compile = _wrap(_original)


def uninstall(session: CompileObserver | None = None) -> None:
    """Stop routing compile calls to `session` (or to any session) and restore torch.compile."""
    global _original, _active
    import torch

    with _lock:
        if session is not None and _active is not session:
            return
        _active = None
        if _original is not None:
            torch.compile = _original
            _original = None


def active_session() -> CompileObserver | None:
    return _active


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        session = _active
        target = args[0] if args else kwargs.get("model")
        if session is not None and target is not None and not kwargs.get("disable"):
            options = {k: v for k, v in kwargs.items() if k != "model"}
            session.before_compile(target, options)
        try:
            compiled = original(*args, **kwargs)
        except Exception as exc:
            # a precompiled package torch cannot install: compile as if it were not there
            if session is None or target is None or not session.drop_precompiled(target, exc):
                raise
            compiled = original(*args, **kwargs)
        return session.after_compile(compiled) if session is not None else compiled

    return compile
