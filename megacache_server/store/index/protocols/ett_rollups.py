"""ETT rollups: the fleet's Effective Training Time per hour and day (`ett_rollups`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from megacache_server.store.index.ett_rollups import Contribution, Roll, Vector

JobKey = tuple[str, str]
"""(namespace, job)."""


class EttRollupStore(ABC):
    """Each job's part of the ETT rollups, and the rollups: hourly and daily rows per
    (namespace, model), shared by every replica (`store.index.ett_rollups`)."""

    @abstractmethod
    async def ett_contributions(self, jobs: list[JobKey]) -> dict[JobKey, Contribution]:
        """The contributions stored for `jobs` (those that have one)."""

    @abstractmethod
    async def roll_ett(self, rolls: list[Roll]) -> int:
        """Apply each roll atomically: its job's contribution becomes `after` and its
        difference from `before` is added to the rows (`ett_rollups.row_deltas`), unless
        the stored contribution is no longer `before` (then that roll is skipped). How
        many were applied."""

    @abstractmethod
    async def ett_models(self, namespace: str) -> set[str]:
        """The models the namespace's rows name (at most `rollups.MAX_MODELS`)."""

    @abstractmethod
    async def ett_rows(self, *, namespace: str | None, period: str, since: int, until: int,
                       model: str | None = None) -> list[tuple[str, str, int, Vector]]:
        """(namespace, model, start, counters as a `Vector`) of the `period` ("h" or "d")
        rows starting in [since, until], of one namespace (None: every one), of one model
        (None: all)."""

    @abstractmethod
    async def ett_top_lost(self, *, namespace: str | None, since: float, limit: int
                           ) -> list[tuple[str, str, str, float, float]]:
        """(namespace, job, model, lost seconds, last seen) of the jobs seen since `since`
        that lost the most (lost progress and recovery), most first."""

    @abstractmethod
    async def ett_roll_mark(self) -> float:
        """When the last roll began (0: never): the next rolls the jobs seen since."""

    @abstractmethod
    async def set_ett_roll_mark(self, at: float) -> None:
        """Record when a roll that finished began."""

    @abstractmethod
    async def prune_ett(self, now: float, jobs_before: float) -> int:
        """Drop rows older than their period is kept and the contributions of jobs not
        seen since `jobs_before` (their rows keep what they added); how many went."""
