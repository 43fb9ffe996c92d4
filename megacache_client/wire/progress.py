"""What a trainer reports of its job's time, for Effective Training Time (ETT).

ETT% = the share of a job's wall time that is training. The client (rank 0 of each attempt)
sends batches of `ProgressRecord`s in the background to `POST /v1/jobs/{job}/progress`; the
server keeps them per job and attempt and splits the job's wall time into the categories
below (`megacache_server.service.ett.split`). Shared by both sides so they cannot disagree.

The records are facts with timestamps (unix seconds, the trainer's clock), never figures the
server takes on trust: the server clamps every interval to the attempt's observed span, so a
lying or broken trainer can spoil only its own job's figures, and no more than its span.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from megacache_client.wire.schema import Doc, Range, Schema, Size, Text

Timestamp = Annotated[float, Range(1_500_000_000, 4_102_444_800)]
"""Unix seconds from 2017 to 2100 (finite: the schema refuses NaN and infinities); the
server also refuses what lies more than `MAX_SKEW_S` ahead of its clock, or further back
than `MAX_AGE_S`."""
Duration = Annotated[float, Range(0, 7 * 24 * 3600)]
Step = Annotated[int, Range(0, 10**12)]
Attempt = Annotated[int, Range(0, 10**6)]
MODEL_CAP = 256
"""The longest model name, in characters."""
ModelName = Annotated[str, Size(1, MODEL_CAP), Text()]

MAX_SKEW_S = 300.0
"""A record timestamped further ahead of the server's clock than this is refused (422)."""
MAX_AGE_S = 30 * 24 * 3600.0
"""A record older than this (by the server's clock) is refused (422)."""
MAX_RECORDS = 256
"""Records in one batch; a client sends more as further batches."""
HEARTBEAT_S = 30.0
"""How often rank 0 sends a heartbeat by default (`MEGACACHE_HEARTBEAT_S`). A killed
attempt's failure is taken at its last fact, so unsaved training time and recovery are off
by at most one interval; 30 s keeps 10,000 jobs at ~333 batches a second."""

Kind = Literal["start", "training", "heartbeat", "checkpoint_save", "checkpoint_load", "end",
               "failure"]
KINDS: tuple[Kind, ...] = ("start", "training", "heartbeat", "checkpoint_save",
                           "checkpoint_load", "end", "failure")
"""- start: the process started (`at`: the process's start time); `allocation_start`: when
  the scheduler gave the job its resources, where known (`MEGACACHE_JOB_START`,
  `SLURM_JOB_START_TIME`), on attempt 0.
- training: the first optimizer step of the attempt ended (`at`); time to start ends here.
- heartbeat: the process is alive at `at`, having finished `step` optimizer steps and
  waited `data_wait_s` in all for its batches since its first step (when measured).
- checkpoint_save: a checkpoint of `step` began at `at`; the training loop waited
  `blocking_s` for it; `background_s` more it was written off the loop (async save), so it
  is durable at `at + blocking_s + background_s`.
- checkpoint_load: a restore began at `at` and took `blocking_s`, resuming from `step`.
- end: the attempt ended at `at`: `reason` finished (the job is done) or failed, and why
  (`cause`, `detail`, `exit_code`); a killed process sends nothing: the server takes its
  last fact.
- failure: what a later attempt learnt of this one's end (sent in this attempt's name by
  the next one's rank 0): it was killed (its lifeline on the node, never ended). An end
  that names its cause stands before it. `at` is when the failure came, as well as it is
  known.
"""

Reason = Literal["finished", "failed"]
Cause = Literal["preempted", "exception", "oom", "collective_timeout", "exit_code", "killed",
                "lost", "unknown"]
CAUSES: tuple[Cause, ...] = ("preempted", "exception", "oom", "collective_timeout",
                             "exit_code", "killed", "lost", "unknown")
"""Why an attempt failed, a bounded set (a Prometheus label):

- preempted: SIGTERM reached rank 0 (the scheduler's notice, a scale-down, torchrun
  stopping the ranks);
- exception: an uncaught exception (`detail`: its type), but for the two below;
- oom: out of memory: `torch.OutOfMemoryError` (CUDA, XPU, MPS), `MemoryError`, an
  allocator's "out of memory" error; or the kernel's OOM killer, as the restart on the
  node finds it (the container's `memory.events`);
- collective_timeout: a collective or process-group store that timed out (gloo's and
  NCCL's timeout errors, the NCCL watchdog's), as an exception;
- exit_code: `sys.exit(n)` with n != 0 (`exit_code`: n; 0 is `finished`);
- killed: no end record, and a later attempt on the same node found it gone (SIGKILL, the
  OOM killer, a crash in native code): what it learnt is in `detail`;
- lost: no end record and nothing later from its node (a node that vanished, or a restart
  on another node): the server's word, never a client's;
- unknown: failed, but nothing says why (an end from an older client, or a rank stopped
  because another failed first)."""
DETAIL_CAP = 200
Detail = Annotated[str, Size(1, DETAIL_CAP), Text()]
ExitCode = Annotated[int, Range(-(2**31), 2**31 - 1)]
PhaseName = Literal["imports", "distributed", "model_build", "first_batch"]
PHASES: tuple[PhaseName, ...] = ("imports", "distributed", "model_build", "first_batch")
"""The parts of a start (or a recovery) the client sees from inside the process
(`ett/phases.py`); the server adds those it sees from outside (docs/ett.md)."""
MAX_PHASES = 64
"""Spans a `training` record carries: a trainer making hundreds of process groups sends
their first spans, and the rest summed into the last one (`count` says how many)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseSpan(Schema):
    """Part of the attempt's way to its first step: `phase` from `at` for `seconds`
    (`count`: how many calls it stands for: process groups made)."""

    phase: PhaseName
    at: Timestamp
    seconds: Duration
    count: Annotated[int, Range(1, 10**6)] = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgressRecord(Schema):
    """One fact of an attempt's time line."""

    LATER_FIELDS = ("data_wait_s", "cause", "detail", "exit_code", "phases")

    kind: Kind
    at: Timestamp
    step: Annotated[Step | None, Doc("optimizer steps finished (heartbeat, checkpoints)")] = None
    blocking_s: Annotated[Duration | None, Doc("checkpoint_save/load: time the training "
                                               "loop waited")] = None
    background_s: Annotated[Duration | None, Doc("checkpoint_save: time spent writing after "
                                                 "the loop went on (async save)")] = None
    allocation_start: Annotated[Timestamp | None, Doc("start: when the job's resources "
                                                      "were allocated")] = None
    data_wait_s: Annotated[Duration | None, Doc(
        "heartbeat: seconds the training loop waited for its next batch since the "
        "attempt's first step, in all (DATA_LOADING_SYNC)")] = None
    reason: Annotated[Reason | None, Doc("end: finished or failed")] = None
    cause: Annotated[Cause | None, Doc("end (failed), failure: why the attempt "
                                       "failed")] = None
    detail: Annotated[Detail | None, Doc("end, failure: what names the cause (an "
                                         "exception's type, a signal, ...)")] = None
    exit_code: Annotated[ExitCode | None, Doc("end: the code of `sys.exit(n)`")] = None
    phases: Annotated[list[PhaseSpan] | None, Doc(
        "training: where the way to the first step went, as the process saw it")] = None

    def validate(self) -> None:
        needs = {"heartbeat": ("step",), "checkpoint_save": ("step", "blocking_s"),
                 "checkpoint_load": ("blocking_s",), "end": ("reason",),
                 "failure": ("cause",)}.get(self.kind, ())
        for name in needs:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.kind} record needs {name}")
        if self.phases is not None and len(self.phases) > MAX_PHASES:
            raise ValueError(f"at most {MAX_PHASES} phases")
        if self.cause in ("lost",):
            raise ValueError("`lost` is the server's word: nothing from the node says it")
        if self.allocation_start is not None and self.allocation_start > self.at:
            raise ValueError("allocation_start cannot be after the process's start")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgressBatch(Schema):
    """What rank 0 of an attempt sends at once (the job is the route's `{job}`)."""

    attempt: Attempt
    records: Annotated[list[ProgressRecord], Size(1, MAX_RECORDS)]
    model: Annotated[ModelName | None, Doc("the model the job trains, for ETT per "
                                           "model")] = None
