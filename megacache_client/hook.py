"""The torch.compile hook: the first compile of a process loads the cache first.

torch.compile is lazy (it compiles on the first call of the returned module), so loading
when torch.compile is *called* is early enough, and that call tells us what the fingerprint
needs: the model (its class names the model, its source gives the code id) and the compile
options. The hook is installed once; only the active session sees compile calls.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megacache_client.session import Session

log = logging.getLogger("megacache")

_lock = threading.Lock()
_original: Any = None
_active: Session | None = None


def install(session: Session) -> None:
    """Route torch.compile calls through `session` (replacing any earlier session)."""
    global _original, _active
    import torch

    with _lock:
        _active = session
        if _original is None:
            _original = torch.compile
            torch.compile = _wrap(_original)


def uninstall(session: Session | None = None) -> None:
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


def active_session() -> Session | None:
    return _active


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        session = _active
        if session is not None:
            module = args[0] if args else kwargs.get("model")
            options = {k: v for k, v in kwargs.items() if k != "model"}
            session.before_compile(module, options)
        compiled = original(*args, **kwargs)
        return session.after_compile(compiled) if session is not None else compiled

    return compile
