"""What a client run reports, shared schema for client and server: one event per run (per
fingerprint it compiled under), sent right after its first compiled step, so a process
killed later has reported its start; its exit then sends only what changed since, as a
follow-up event (`Event.followup`)."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Annotated, Literal

from megacache_client.wire.manifest import Hex64
from megacache_client.wire.schema import Doc, Match, Range, Schema, Size, Text

Outcome = Literal["hit", "fallback", "miss", "invalid", "error", "inert"]
OUTCOMES: tuple[Outcome, ...] = ("hit", "fallback", "miss", "invalid", "error", "inert")
Replay = Literal["full", "partial", "rebuilt"]
REPLAYS: tuple[Replay, ...] = ("full", "partial", "rebuilt")
"""Whether a run replayed the entry's artifacts: all of them (torch compiled nothing anew),
some, or none (`megacache_client.steps.report.replay` says when each)."""

Seconds = Annotated[float, Range(0, 7 * 24 * 3600)]
"""No run compiles, loads or saves more than a week."""
Bytes = Annotated[int, Range(0, 2**40)]
"""No run moves more than a TiB; sums of bounded values stay exact far past any fleet's life."""
Count = Annotated[int, Range(0, 10**6)]
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""As the server's job routes take it: 1-128 of letters, digits, `.`, `_`, `-`."""
JobId = Annotated[str, Match(JOB_ID_PATTERN)]


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event(Schema):
    """One client run's view: did the cache help, and by how much."""

    LATER_FIELDS = ("followup",)

    key: Hex64
    model: Annotated[str, Size(1, 256), Text()]
    outcome: Outcome
    reason: Annotated[str, Size(0, 2000), Text()] = ""
    entry_key: Annotated[Hex64 | None, Doc("the entry loaded, if any")] = None
    differing: Annotated[list[Annotated[str, Size(0, 32), Text()]], Size(0, 8)] = \
        dataclasses.field(default_factory=list)
    compile_s: Seconds = 0.0
    cold_compile_s: Seconds | None = None
    saved_s: Seconds = 0.0
    load_s: Seconds = 0.0
    bytes_down: Bytes = 0
    bytes_up: Bytes = 0
    fxgraph_hit: Count = 0
    fxgraph_miss: Count = 0
    published: bool = False
    precompile_hit: Annotated[Count, Doc("torch's Dynamo cache hits (precompiled Dynamo "
                                         "output used)")] = 0
    precompile_miss: Annotated[Count, Doc("Dynamo cache misses and errors")] = 0
    precompile_reason: Annotated[str, Size(0, 500), Text(), Doc("why precompiled Dynamo output was "
                                                        "off or not loaded")] = ""
    tts_s: Annotated[Seconds | None, Doc("time to start: process start to the end of the "
                                         "first compiled step")] = None
    tts_import_s: Annotated[Seconds | None, Doc("process start to the client enabled "
                                                "(imports)")] = None
    tts_fetch_s: Annotated[Seconds | None, Doc("first compile waiting for lookups and "
                                               "downloads")] = None
    tts_load_s: Annotated[Seconds | None, Doc("fingerprint, placing files and loading the "
                                              "bundle")] = None
    tts_compile_s: Annotated[Seconds | None, Doc("torch compile seconds up to the first "
                                                 "step's end")] = None
    tts_rest_s: Annotated[Seconds | None, Doc("the remainder: trainer set-up, data, running "
                                              "the step")] = None
    job_id: Annotated[JobId | None, Doc("the job this run belongs to; without one the run "
                                        "counts as its own start")] = None
    attempt: Annotated[Annotated[int, Range(0, 10**6)] | None,
                       Doc("the job's attempt: 0 is its start, later ones recoveries")] = None
    rank: Annotated[Annotated[int, Range(0, 10**6)] | None, Doc("this process's rank")] = None
    world_size: Annotated[Annotated[int, Range(1, 10**6)] | None,
                          Doc("ranks in the job attempt")] = None
    replay: Annotated[Replay | None, Doc(
        "full: the run loaded an entry and torch compiled nothing anew (FX graph and "
        "AOTAutograd cache misses 0, some hit); partial: some hits, some misses; rebuilt: "
        "no cache hit at all. On the process's first event only; none from older "
        "clients")] = None
    followup: Annotated[bool, Doc(
        "what a process's exit adds to the events it sent after its first step: compile "
        "seconds, bytes and cache lookups since, and whether it published; counts no new "
        "run, outcome, replay or time to start")] = False
    created_at: datetime = dataclasses.field(default_factory=_now)

    def validate(self) -> None:
        if self.followup and (self.tts_s is not None or self.replay is not None
                              or self.saved_s):
            raise ValueError("a follow-up event carries no time to start, replay or "
                             "seconds saved (its run's first event did)")
        if self.saved_s > (self.cold_compile_s or 0.0):
            raise ValueError("saved_s cannot exceed cold_compile_s (the cold compile it saved)")
        if self.rank is not None and self.world_size is not None \
                and self.rank >= self.world_size:
            raise ValueError("rank must be below world_size")
