"""The public entry points: `enable()`, `session()` (context manager) and `cached` (decorator);
for a job's Effective Training Time, `checkpoint()` (context manager), `checkpoint_saved()`
and `checkpoint_loaded()` (`ett/telemetry.py`); `warm_up()` compiles on a fast batch in
the background while the data loader fills (`torch/warmup.py`)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from megacache_client.config import ClientConfig
from megacache_client.errors import MegacacheError
from megacache_client.ett import telemetry
from megacache_client.ett.telemetry import checkpoint, checkpoint_loaded, checkpoint_saved
from megacache_client.lifecycle import Session
from megacache_client.steps import preemption
from megacache_client.steps.prefetch import Prefetcher
from megacache_client.torch import hook, supported
from megacache_client.torch.warmup import WarmUp, warm_up

__all__ = ["WarmUp", "cached", "checkpoint", "checkpoint_loaded", "checkpoint_saved", "disable",
           "enable", "session", "warm_up"]

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("megacache")


def enable(*, model: str | None = None, code: str | None = None,
           compile_options: dict[str, Any] | None = None, load_now: bool = False,
           **config: Any) -> Session:
    """Turn the cache on for this process.

    Configuration comes from keyword arguments, else `MEGACACHE_*` variables (`url`, `token`,
    `mode`, ...). The first `torch.compile` call loads the matching bundle; after the first
    compiled step the run is reported and, once the compile has settled, published in the
    background; the process exit (or `session.close()`), and SIGTERM within a bounded grace,
    publish what is left and report what changed. With no URL, or
    `mode="off"`, this returns a session that does nothing; so does a torch outside
    `supported.SUPPORTED_TORCH` (one warning, no network traffic, outcome `inert`).
    """
    cfg = ClientConfig.from_env(model=model, code=code, **config)
    if cfg.enabled:
        why = supported.problem()
        if why:
            return _inert(cfg, why, compile_options)
    session = Session(cfg, compile_options=compile_options)
    if cfg.enabled:
        _adopt(session, _active())
        session.start()
        hook.install(session)
        atexit.register(_close_at_exit, session)
        _start_telemetry(session)
        if cfg.term_grace_s > 0:
            preemption.install(cfg.term_grace_s, [_progress_on_sigterm, _publish_on_sigterm])
        if load_now:
            session.load(options=compile_options)
    return session


def _inert(cfg: ClientConfig, why: str, compile_options: dict[str, Any] | None) -> Session:
    """A session that does nothing, for a torch the client does not support: its load
    result says `inert` and why; nothing is installed, fetched, published or reported."""
    if cfg.mode == "required":
        raise MegacacheError(f"megacache inert: {why}")
    supported.warn_once(why)
    session = Session(dataclasses.replace(cfg, mode="off"), compile_options=compile_options)
    session.load_result.outcome, session.load_result.reason = "inert", why
    return session


def _active() -> Session | None:
    """The session the torch.compile hook routes to (the hook knows it only as an observer)."""
    active = hook.active_session()
    return active if isinstance(active, Session) else None


def _adopt(new: Session, old: Session | None) -> None:
    """An explicit enable() after the zero-code hook's: one session per process.

    The hook's session has compiled nothing yet (else it stays): the new one takes over its
    prefetch, whose downloads then count in the new session's event, and the old one retires
    without publishing or reporting.
    """
    if old is None or old.tracks or old.config.url != new.config.url:
        return
    if old.prefetcher is not None and (old.config.model, old.config.code) != (
            new.config.model, new.config.code) and new.config.prefetch:
        # the hook knew no model: a new prefetch continues the old one with the model's entry
        new.prefetcher = Prefetcher(new.config, new.node, previous=old.prefetcher).start()
    else:
        new.prefetcher = old.prefetcher
    old.retire()


def _start_telemetry(session: Session) -> None:
    """Rank 0 of a job sends its progress from now on (registered after the session's exit
    handler, so the job's end is sent before the exit's publish)."""
    # zero-code, `import torch` returns to the trainer once this enable is done: its
    # imports end now; an explicit enable() ends them at its call
    zero_code = getattr(sys.modules.get("megacache_autoload"), "TORCH_IMPORTED", None)
    imported = time.time() if zero_code else session.clock.enabled_at
    try:
        telemetry.start(session.config, session.job, session.clock.started, _model, imported)
    except Exception as exc:  # never let telemetry break the trainer
        log.info("megacache: job telemetry off: %s: %s", type(exc).__name__, exc)


def _progress_on_sigterm(deadline: float, ending: bool) -> None:
    """SIGTERM: the job's last sign of life (its end, when the signal ends the process)."""
    t = telemetry.active()
    if t is not None:
        t.preempted(deadline, ending)


def _publish_on_sigterm(deadline: float, _ending: bool) -> None:
    """SIGTERM: the publish under way finished, or one run, by `deadline`."""
    s = _active()
    if s is not None:
        s.preempted(deadline)


def _model() -> str | None:
    """The model the active session compiles (what the job trains), when known."""
    s = _active()
    if s is None:
        return None
    fp = s.fp
    return s.model or (fp.model if fp is not None else None)


def disable(session: Session | None = None) -> None:
    """Publish and report (bounded wait), then restore torch.compile."""
    target = session or _active()
    if target is not None:
        target.close()
    hook.uninstall(target)


@contextlib.contextmanager
def session(**kwargs: Any) -> Iterator[Session]:
    """`with megacache_client.session(model="mlp"): ...` — what is left published and
    reported at the block's exit."""
    s = enable(**kwargs)
    try:
        yield s
    finally:
        disable(s)


def cached(**kwargs: Any) -> Callable[[F], F]:
    """Decorator form: the wrapped function (a training entry point) runs inside a session."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            with session(**kwargs):
                return fn(*args, **kw)

        return wrapper  # type: ignore[return-value]

    return decorate


def _close_at_exit(s: Session) -> None:
    try:
        s.close()
    finally:
        hook.uninstall(s)
