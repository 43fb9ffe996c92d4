"""Where a start (or a recovery) went: its time split into components. Pure, like `ett`.

Time to start runs from the allocation (or the process's start) to the first optimizer
step; time to recover from the failure to the next attempt's first step. Each is painted
like the job's split (`ett._paint`): every second of it gets exactly one component, the
first of these that covers it, so the components add up to the figure exactly:

  checkpoint_restore  each checkpoint load's blocking time (the attempt's `checkpoint_load`)
  compile             the attempt's compile seconds (its slowest rank's, from the cache's
                      events), just before its first step (as the split places it)
  distributed         `init_process_group` and every `new_group`, as the process timed
                      them (spans; `process_groups`: how many groups it made)
  first_batch         from the first `DataLoader` iterator's start to its first batch
  model_build         from the first parameter made to the end of the first optimizer's
                      construction
  first_step          from the first batch to the first optimizer step's end (the step
                      itself, compile aside)
  imports             the interpreter's start-up and imports: process start to the end
                      of `import torch`
  allocation_wait     attempt 0: from the allocation to the process's start
  restart_wait        a recovery: from the failure to the new process's start (the
                      launcher's or the scheduler's restart, a new allocation)
  other               the rest: the trainer's own code between them

Spans are the trainer's clock, clamped to the figure's interval: a lying trainer can move
seconds between components, never change the figure.
"""

from __future__ import annotations

from typing import Any

from megacache_server.store.index.progress import AttemptProgress

COMPONENTS = ("allocation_wait", "restart_wait", "imports", "distributed", "model_build",
              "checkpoint_restore", "first_batch", "compile", "first_step", "other")
"""In the order of a start (the stacked bar's)."""
PRIORITY = ("checkpoint_restore", "compile", "distributed", "first_batch", "model_build",
            "first_step", "imports", "allocation_wait", "restart_wait")
"""Highest first: what a second covered by several spans counts as (the rest: other)."""

Interval = tuple[float, float, str]


def components(a: AttemptProgress, lo: float, train: float, *, recovering: bool,
               compile_s: float) -> dict[str, Any]:
    """The components of [lo, train] (time to start, or to recover from `lo`), in seconds,
    and the process groups the attempt made."""
    from megacache_server.service.ett.split import _paint  # one painter for both splits

    spans: list[Interval] = []
    if a.start_at is not None:
        if recovering:
            spans.append((lo, a.start_at, "restart_wait"))
        elif a.allocation_start is not None:
            spans.append((a.allocation_start, a.start_at, "allocation_wait"))
    groups = 0
    for p in a.phases:
        spans.append((p.at, p.at + p.seconds, p.phase))
        if p.phase == "distributed":
            groups += p.calls
    batches = [p.at + p.seconds for p in a.phases if p.phase == "first_batch"]
    if batches:
        spans.append((max(batches), train, "first_step"))
    if compile_s > 0:
        spans.append((train - compile_s, train, "compile"))
    spans += [(k.at, k.at + k.blocking_s, "checkpoint_restore") for k in a.loads]
    seconds = dict.fromkeys(COMPONENTS, 0.0)
    for s, e, c in _paint(spans, lo, train, PRIORITY, "other"):
        seconds[c] += e - s
    return {"seconds": {k: round(v, 3) for k, v in seconds.items()},
            "process_groups": groups}
