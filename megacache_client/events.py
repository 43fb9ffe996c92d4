"""What a client run reports: one event per run, shared schema for client and server."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from megacache_client.manifest import Hex64

Outcome = Literal["hit", "fallback", "miss", "invalid", "error", "inert"]
OUTCOMES: tuple[Outcome, ...] = ("hit", "fallback", "miss", "invalid", "error", "inert")

Seconds = Annotated[float, Field(ge=0, le=7 * 24 * 3600, allow_inf_nan=False)]
"""No run compiles, loads or saves more than a week."""
Bytes = Annotated[int, Field(ge=0, le=2**40)]
"""No run moves more than a TiB; sums of bounded values stay exact far past any fleet's life."""
Count = Annotated[int, Field(ge=0, le=10**6)]


class Event(BaseModel):
    """One client run's view: did the cache help, and by how much."""

    model_config = ConfigDict(extra="forbid", strict=True)

    key: Hex64
    model: str = Field(min_length=1, max_length=256)
    outcome: Outcome
    reason: str = Field(default="", max_length=2000)
    entry_key: Hex64 | None = Field(default=None, description="the entry loaded, if any")
    differing: list[Annotated[str, Field(max_length=32)]] = Field(default_factory=list,
                                                                  max_length=8)
    compile_s: Seconds = 0.0
    cold_compile_s: Seconds | None = None
    saved_s: Seconds = 0.0
    load_s: Seconds = 0.0
    bytes_down: Bytes = 0
    bytes_up: Bytes = 0
    fxgraph_hit: Count = 0
    fxgraph_miss: Count = 0
    published: bool = False
    precompile_hit: Count = Field(default=0, description="torch's Dynamo cache hits "
                                  "(precompiled Dynamo output used)")
    precompile_miss: Count = Field(default=0, description="Dynamo cache misses and errors")
    precompile_reason: str = Field(default="", max_length=500,
                                   description="why precompiled Dynamo output was off or "
                                   "not loaded")
    tts_s: Seconds | None = Field(default=None, description="time to start: process start "
                                  "to the end of the first compiled step")
    tts_import_s: Seconds | None = Field(default=None, description="process start to the "
                                         "client enabled (imports)")
    tts_fetch_s: Seconds | None = Field(default=None, description="first compile waiting "
                                        "for lookups and downloads")
    tts_load_s: Seconds | None = Field(default=None, description="fingerprint, placing files "
                                       "and loading the bundle")
    tts_compile_s: Seconds | None = Field(default=None, description="torch compile seconds "
                                          "up to the first step's end")
    tts_rest_s: Seconds | None = Field(default=None, description="the remainder: trainer "
                                       "set-up, data, running the step")
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @model_validator(mode="after")
    def _saves_no_more_than_it_would_have_compiled(self) -> Event:
        if self.saved_s > (self.cold_compile_s or 0.0):
            raise ValueError("saved_s cannot exceed cold_compile_s (the cold compile it saved)")
        return self
