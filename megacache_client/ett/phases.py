"""Where the way to the first optimizer step went, as torch lets the process see it.

Rank 0's telemetry (`telemetry.py`) installs these with its hooks and sends the spans with
its `training` record (the first step's); the server paints them over the attempt's time to
start or to recover (`service.ett.components`), adding what it sees from outside (the
allocation's wait, a restart's, the compile seconds, checkpoint restores). Each span is
timed where torch lets a client see it:

- imports: process start (the kernel's record: `start_clock`) to the end of
  `import torch` as the trainer sees it (zero-code: the client's enable included, which
  runs inside it); with an explicit `enable()`, to its call (later than `import torch`
  by whatever the trainer ran between);
- distributed: each call of `init_process_group`, `new_group`, `split_group` (and the
  group making under `DeviceMesh`: `_new_group_with_tag`, `_new_process_group_helper`),
  outermost only, on any thread; `count`: the process groups made (each
  `_new_process_group_helper` call: the report's "unnecessary process-group creations");
- model_build: from the first parameter registered on a module (torch's global
  registration hook) to the end of the first optimizer's construction
  (`Optimizer.__init__`);
- first_batch: from the first `DataLoader` iterator's construction (its workers start
  there) to its first batch (`dataloading.py`).

Only spans before the first step are kept, at most `MAX_PHASES` (more process groups are
summed into the last span, `count` saying how many). The hooks cost nothing per training
step: the parameter hook is removed at the first step (until then it costs a comparison
per parameter made), and the wrappers of the process-group calls read one flag.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from megacache_client.wire.progress import MAX_PHASES, PhaseName, PhaseSpan

log = logging.getLogger("megacache")

GROUP_CALLS = ("init_process_group", "new_group", "split_group", "_new_group_with_tag",
               "_new_process_group_helper")
"""The process-group calls timed; the last one makes each group (counted)."""

_depth = threading.local()


class Phases:
    """The spans of one attempt's way to its first step."""

    def __init__(self, started: float, imported: float | None) -> None:
        self.spans: list[PhaseSpan] = []
        self.open = True
        """Before the first step: spans are kept."""
        self.first_param: float | None = None
        self.built = False
        self.batch_seen = False
        self._lock = threading.Lock()
        self._param_handle: Any = None
        if imported is not None and imported > started:
            self.add("imports", started, imported - started)

    def add(self, phase: PhaseName, at: float, seconds: float, count: int = 1) -> None:
        """A span (before the first step only; past MAX_PHASES, summed into the last)."""
        if not self.open or seconds < 0:
            return
        with self._lock:
            try:
                if len(self.spans) < MAX_PHASES:
                    self.spans.append(PhaseSpan(phase=phase, at=at, seconds=seconds,
                                                count=count))
                    return
                last = self.spans[-1]
                self.spans[-1] = PhaseSpan(phase=last.phase, at=last.at,
                                           seconds=min(last.seconds + seconds, 7 * 86400),
                                           count=min(last.count + count, 10**6))
            except ValueError as exc:  # a clock out of range: this span only
                log.debug("megacache: phase not kept: %s", exc)

    def first_step(self) -> list[PhaseSpan] | None:
        """The first step ended: the spans so far (None: none), and no more."""
        self.open = False
        if self._param_handle is not None:
            self._param_handle.remove()
            self._param_handle = None
        with self._lock:
            return list(self.spans) or None

    # -- model and optimizer ------------------------------------------------------------
    def on_parameter(self, *_args: Any) -> None:
        """torch's global parameter registration hook (removed at the first step, never
        from inside itself: torch is iterating its hooks)."""
        if self.first_param is None:
            self.first_param = time.time()

    def on_optimizer_built(self) -> None:
        if self.built or not self.open:
            return
        self.built = True
        if self.first_param is not None:
            self.add("model_build", self.first_param, time.time() - self.first_param)

    # -- the first batch ----------------------------------------------------------------
    def on_first_batch(self, began: float) -> None:
        if not self.batch_seen:
            self.batch_seen = True
            self.add("first_batch", began, time.time() - began)

    def install(self) -> None:
        """The hooks (once per process: later attempts' processes are new)."""
        import torch
        from torch.nn.modules.module import register_module_parameter_registration_hook

        self._param_handle = register_module_parameter_registration_hook(self.on_parameter)
        _wrap_optimizer_init(torch.optim.Optimizer)
        try:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d
        except ImportError:  # a torch built without distributed
            return
        if not dist.is_available():
            return
        for name in GROUP_CALLS:
            for owner in (c10d, dist):
                fn = getattr(owner, name, None)
                if callable(fn) and not getattr(fn, "_megacache_phase", False):
                    setattr(owner, name, _timed_group_call(fn, name))


def _nobody() -> Phases | None:
    return None


_active: Callable[[], Phases | None] = _nobody


def watch(active: Callable[[], Phases | None]) -> None:
    """Send what the hooks see to `active()` (the running attempt's phases)."""
    global _active
    _active = active


def _wrap_optimizer_init(base: Any) -> None:
    init = base.__init__
    if getattr(init, "_megacache_phase", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        phases = _active()
        if phases is not None and phases.open:
            phases.on_optimizer_built()

    __init__._megacache_phase = True  # type: ignore[attr-defined]
    base.__init__ = __init__


def _timed_group_call(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` timed as a `distributed` span when it is the outermost such call, and counted
    as a group made when it is `_new_process_group_helper`."""
    counts = name == "_new_process_group_helper"

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        phases = _active()
        if phases is None or not phases.open:
            return fn(*args, **kwargs)
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        at, began = time.time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n = depth
            if counts:
                _depth.groups = getattr(_depth, "groups", 0) + 1
            if depth == 0:
                groups, _depth.groups = getattr(_depth, "groups", 0), 0
                phases.add("distributed", at, time.perf_counter() - began, max(groups, 1))

    timed._megacache_phase = True  # type: ignore[attr-defined]
    return timed
