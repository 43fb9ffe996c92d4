"""What a client run reports: one event per run, shared schema for client and server."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from megacache_client.manifest import Hex64

Outcome = Literal["hit", "fallback", "miss", "invalid", "error", "inert"]
OUTCOMES: tuple[Outcome, ...] = ("hit", "fallback", "miss", "invalid", "error", "inert")

NonNegative = Annotated[float, Field(ge=0, le=30 * 24 * 3600)]
Count = Annotated[int, Field(ge=0, le=2**53)]
"""Bounded so every backend stores it exactly (SQLite integers are 64-bit)."""


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
    compile_s: NonNegative = 0.0
    cold_compile_s: NonNegative | None = None
    saved_s: NonNegative = 0.0
    load_s: NonNegative = 0.0
    bytes_down: Count = 0
    bytes_up: Count = 0
    fxgraph_hit: Count = 0
    fxgraph_miss: Count = 0
    published: bool = False
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
