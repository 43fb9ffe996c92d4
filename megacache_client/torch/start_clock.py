"""Time to start: process start -> end of the first compiled step, and where it went.

The figure a cache exists to shrink is not compile seconds but how long a new process takes
to train: imports, fetching the cache, loading it, whatever compiling is left, and the
trainer's own set-up. This module measures it from the process's real start (the kernel's
record, so interpreter start-up and `import torch` count) to the end of the first compiled
step: the end of the first backward pass through a compiled module's output, or the end of
its first call when that output needs no gradient. The split:

- import: process start -> the client enabled (right after `import torch` in zero-code mode)
- fetch: seconds the first compile waited for downloads (what prefetch did not hide)
- load: seconds placing files and loading the bundle into torch's caches
- compile: torch's own compile seconds up to the first step's end
- rest: the remainder (trainer set-up, data loading, running the step itself)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

MODULE_LOADED = time.time()
MAX_SECONDS = 7 * 24 * 3600.0
"""Longer than any real start; keeps a broken clock out of the stats (the Event bound)."""


def process_start_time() -> float:
    """Epoch seconds at which this process started (Linux /proc), else this module's import.

    The kernel records the start in clock ticks since boot; its age is measured on the same
    clock (CLOCK_BOOTTIME) and taken from the wall clock now. Adding the ticks to the boot
    time in /proc/stat instead is off by up to a second or more: btime has 1 s resolution
    and the wall clock drifts from the boot clock (seen on a VM: starts 0.3 s too late,
    a time to start shorter than the trainer's own clock).
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        started = time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return MODULE_LOADED
    # never report a start after this module was imported
    return min(started, MODULE_LOADED)


_quiet = threading.local()


@contextlib.contextmanager
def not_a_step() -> Iterator[None]:
    """Calls of compiled models in this block, on this thread, are not the first step
    (`warmup.py` compiles on a fast batch in the background; the step is the loop's)."""
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = False


def _counts() -> bool:
    return not getattr(_quiet, "on", False)


def _seconds(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(min(max(value, 0.0), MAX_SECONDS), 3)


@dataclass
class TimeToStart:
    """The clock of one process's start; times are epoch seconds, durations seconds."""

    started: float = 0.0
    enabled_at: float | None = None
    forward_end: float | None = None
    first_step_end: float | None = None
    fetch_s: float = 0.0
    load_s: float = 0.0
    compile_s: float | None = None
    on_first_step: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Called once, when the first compiled step has ended (the session reports and starts
    watching for a settled point to publish at); must return at once."""

    def __post_init__(self) -> None:
        if not self.started:
            self.started = process_start_time()
        self._lock = threading.Lock()

    def mark_enabled(self) -> None:
        if self.enabled_at is None:
            self.enabled_at = time.time()

    def forward_done(self, compile_s: float) -> None:
        """The first compiled call returned; stands for the step if no backward follows."""
        with self._lock:
            if self.forward_end is None:
                self.forward_end = time.time()
                self.compile_s = compile_s

    def step_done(self, compile_s: float) -> None:
        with self._lock:
            if self.first_step_end is None:
                self.first_step_end = time.time()
                self.compile_s = compile_s
        self.first_step_over()

    def first_step_over(self) -> None:
        """The first step is over (its backward ended, or its forward needed none)."""
        with self._lock:
            callback, self.on_first_step = self.on_first_step, None
        if callback is not None:
            try:
                callback()
            except Exception:  # timing must never disturb training
                return

    def fields(self) -> dict[str, float | None]:
        """The Event's tts_* fields (all None until a compiled call has returned)."""
        end = self.first_step_end or self.forward_end
        names = ("tts_s", "tts_import_s", "tts_fetch_s", "tts_load_s", "tts_compile_s",
                 "tts_rest_s")
        if end is None:
            return dict.fromkeys(names)
        total = end - self.started
        imported = (self.enabled_at or self.started) - self.started
        compile_s = self.compile_s or 0.0
        rest = total - imported - self.fetch_s - self.load_s - compile_s
        values = (total, imported, self.fetch_s, self.load_s, compile_s, max(rest, 0.0))
        return {name: _seconds(v) for name, v in zip(names, values, strict=True)}


def watch(compiled: Any, clock: TimeToStart) -> Any:
    """Return `compiled` set up to tell `clock` when its first step ends.

    A compiled module gets a forward hook (it runs outside Dynamo's frame, on the wrapper
    torch.compile returns); a compiled function gets a thin wrapper. Either removes itself
    from the work after the first call: the hook is unregistered, the wrapper checks a flag.
    """
    import torch

    if isinstance(compiled, torch.nn.Module):
        handle: list[Any] = []

        def hook(_module: Any, _args: Any, output: Any) -> None:
            if not _counts():
                return
            handle[0].remove()
            _first_output(output, clock)

        handle.append(compiled.register_forward_hook(hook))
        return compiled
    if not callable(compiled):
        return compiled
    seen = [False]

    @functools.wraps(compiled)
    def first_call_watcher(*args: Any, **kwargs: Any) -> Any:
        out = compiled(*args, **kwargs)
        if not seen[0] and _counts():
            seen[0] = True
            _first_output(out, clock)
        return out

    return first_call_watcher


def _first_output(output: Any, clock: TimeToStart) -> None:
    """Mark the forward's end; if its output will be differentiated, mark backward's end too."""
    try:
        import torch
        from torch.utils._pytree import tree_leaves

        from megacache_client.torch import env as torch_env

        clock.forward_done(torch_env.compile_seconds())
        node = next((leaf.grad_fn for leaf in tree_leaves(output)
                     if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None),
                    None) if torch.is_grad_enabled() else None
        if node is None:
            clock.first_step_over()
            return

        def at_backward_end() -> None:
            clock.step_done(torch_env.compile_seconds())

        def before_node(_grad_outputs: Any) -> None:
            # Runs when backward reaches the output; the callback runs when it finishes.
            torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)

        node.register_prehook(before_node)
    except Exception:  # timing must never disturb training
        return
