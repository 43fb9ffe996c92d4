"""Compile on a fast batch in the background, while the DataLoader fills and DDP starts.

A cold start pays compile + data: the first batch waits for the loader's workers, then the
first step waits for Dynamo, AOTAutograd and Inductor. Neither needs the other. `warm_up`
runs the compiled model's forward and backward once on a batch the trainer can make at
once (same shapes and dtypes as the real ones, any values the model accepts) in a thread,
so the compile happens while the workers fill; a start then costs max(compile, data).

It leaves no trace on the model: the backward is `torch.autograd.grad` on the parameters,
so no `.grad` is written (None stays None) and no AccumulateGrad hook (DDP's reducer,
optimizer-in-backward) runs; buffers (BatchNorm's running stats, `num_batches_tracked`)
are restored from a snapshot; torch's CPU and CUDA generators are put back to where they
were when `warm_up` was called; no optimizer is involved. It runs in the model's real mode
(train): an eval-mode run would compile eval graphs the first step could not use.

Safe concurrency: Dynamo compiles under one process-wide lock, but a call that misses the
cache while another thread compiles waits for that lock and then compiles the same frame
again. So the first call of the model from another thread waits for the warm-up (a forward
pre-hook on the module passed), and the first step finds everything compiled. A warm-up
that fails (a batch of the wrong shape, a model Dynamo rejects) logs one warning and
leaves the model as it was: the first step compiles, as it would have.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from megacache_client.torch import start_clock

log = logging.getLogger("megacache")

__all__ = ["WarmUp", "warm_up"]


class WarmUp:
    """The handle of one warm-up: `wait(timeout)`, then `seconds` (or `error`)."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        """Seconds the warm-up took (forward, backward and the restore), once it ended."""
        self.error: str | None = None
        """Why it failed (it warned once), None when it succeeded or is still running."""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> float | None:
        """Wait up to `timeout` seconds (None: until it ends); the warm-up's seconds, or
        None if it is still running or failed."""
        self._done.wait(timeout)
        return self.seconds if self.done and self.error is None else None

    def _run(self, model: Any, batch: Any, backward: bool, rng: Any) -> None:
        began = time.monotonic()
        try:
            with start_clock.not_a_step(), _restored(model, rng):
                _forward_backward(model, batch, backward)
        except Exception as exc:  # a warm-up must never break training
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("megacache: warm-up failed (%s); the first step compiles as usual",
                        self.error)
        else:
            self.seconds = round(time.monotonic() - began, 3)
            log.info("megacache: warm-up compiled in %.2fs", self.seconds)
        finally:
            self._done.set()


def warm_up(model: Any, batch: Any, *, backward: bool = True) -> WarmUp:
    """Compile `model`'s forward (and backward) on `batch` in a background thread.

    `model`: what the training loop calls: a `torch.compile`d module or function, or a
    `DistributedDataParallel` around a compiled module (its inner module is run inside
    DDP's forward context, so Dynamo makes DDPOptimizer's bucketed graphs, with no
    collective and no reducer). `batch`: a tensor (`model(batch)`), a tuple or list
    (`model(*batch)`) or a dict (`model(**batch)`) shaped like the real batches. Until the
    handle is done, nothing may change the model (no DDP wrapping, `load_state_dict`,
    `.to()`) and no other thread should draw from torch's generators (create the
    DataLoader's iterator, which draws its seed, before calling this). The first call of a
    module from another thread waits for the warm-up by itself.
    """
    handle = WarmUp()
    try:
        rng = _rng_state()
        run_model = _runner(model)
    except Exception as exc:
        handle.error = f"{type(exc).__name__}: {exc}"
        log.warning("megacache: warm-up skipped (%s)", handle.error)
        handle._done.set()
        return handle
    thread = threading.Thread(target=handle._run, args=(run_model, batch, backward, rng),
                              name="megacache-warm-up", daemon=True)
    handle._thread = thread
    _first_call_waits(model, handle, thread)
    thread.start()
    return handle


def _runner(model: Any) -> Any:
    """The callable the warm-up runs: DDP's inner module inside DDP's forward context."""
    import torch

    ddp = _ddp_class()
    if ddp is not None and isinstance(model, ddp):
        inner = model.module

        def in_ddp(*args: Any, **kwargs: Any) -> Any:
            with model._inside_ddp_forward():
                return inner(*args, **kwargs)

        in_ddp.warm_target = inner  # type: ignore[attr-defined]
        return in_ddp
    orig = getattr(model, "_orig_mod", None)
    if ddp is not None and isinstance(orig, ddp):
        raise TypeError("torch.compile(DDP(model)) runs DDP's collectives on every call: "
                        "warm up DDP(torch.compile(model)) instead")
    if not callable(model):
        raise TypeError(f"{type(model).__name__} is not callable")
    if isinstance(model, torch.nn.Module) and not hasattr(model, "_orig_mod"):
        log.info("megacache: warm-up of a module torch.compile did not wrap: nothing to "
                 "compile unless its forward is compiled")
    return model


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed
        return None
    return DistributedDataParallel


def _forward_backward(model: Any, batch: Any, backward: bool) -> None:
    import torch
    from torch.utils._pytree import tree_leaves

    with torch.enable_grad():
        if isinstance(batch, dict):
            out = model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = model(*batch)
        else:
            out = model(batch)
        if not backward:
            return
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                and t.grad_fn is not None]
        params = [p for p in _module(model).parameters() if p.requires_grad] \
            if _module(model) is not None else []
        if not outs or not params:
            return
        # autograd.grad, not backward(): the grads are returned, never accumulated
        torch.autograd.grad(outs, params, grad_outputs=[torch.ones_like(t) for t in outs],
                            allow_unused=True)


def _module(model: Any) -> Any:
    import torch

    target = getattr(model, "warm_target", model)
    return target if isinstance(target, torch.nn.Module) else None


@contextlib.contextmanager
def _restored(model: Any, rng: Any) -> Iterator[None]:
    """Buffers and torch's generators as they were, whatever happens inside."""
    import torch

    module = _module(model)
    buffers = [(b, b.detach().clone()) for b in module.buffers()] if module is not None \
        else []
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        _set_rng_state(rng)


def _rng_state() -> tuple[Any, Any]:
    """torch's CPU generator, and every CUDA device's when CUDA is initialised."""
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, Any]) -> None:
    import torch

    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _first_call_waits(model: Any, handle: WarmUp, thread: threading.Thread) -> None:
    """A module's first call from another thread waits for the warm-up: a call that
    misses Dynamo's cache while the warm-up compiles would compile the frame twice."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return  # a compiled function: the caller waits with handle.wait()
    hook: list[Any] = []

    def wait_first(_module: Any, _args: Any) -> None:
        if threading.current_thread() is thread:
            return
        hook[0].remove()
        handle.wait()

    hook.append(model.register_forward_pre_hook(wait_first))
