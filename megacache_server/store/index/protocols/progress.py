"""Progress: what trainers report of their jobs' time, kept as bounded summaries."""

from __future__ import annotations

from abc import ABC, abstractmethod

from megacache_client.wire.progress import ProgressRecord
from megacache_server.store.index.progress import AttemptProgress, Fold, JobProgress, JobStamps

AttemptKey = tuple[str, str, int]
"""(namespace, job, attempt)."""


class ProgressStore(ABC):
    """What trainers report of their jobs' time (`POST /v1/jobs/{job}/progress`), per
    (namespace, job, attempt) as a bounded summary (`progress.AttemptProgress`, folded by
    `progress.merge`), shared by every worker and replica. The same job id in two
    namespaces is two jobs."""

    async def add_progress(self, namespace: str, job: str, attempt: int, model: str | None,
                           records: list[ProgressRecord], now: float, *,
                           namespace_attempts: int | None = None) -> None:
        """Fold `records` into the attempt's summary, atomically across processes (two
        batches of one attempt at once lose neither). A job keeps its newest
        `progress.MAX_ATTEMPTS` attempts, a namespace the `progress.MAX_JOBS` jobs that
        reported last, and at most `namespace_attempts` attempts (the namespace's progress
        budget, `MEGACACHE_PROGRESS_NAMESPACE_ATTEMPTS`): past it, its longest-silent jobs go
        whole. Whatever a caller sends, what is kept stays bounded."""
        await self.add_progress_many([Fold(namespace, job, attempt, model, records, now,
                                           len(records))],
                                     namespace_attempts=namespace_attempts)

    @abstractmethod
    async def add_progress_many(self, folds: list[Fold], *,
                                namespace_attempts: int | None = None) -> None:
        """`add_progress` for each of `folds` (other attempts, other jobs, other namespaces)
        in one transaction or pipeline: what a server's coalesced heartbeats are written
        with (`service.ett.beats`)."""

    @abstractmethod
    async def job_progress(self, namespace: str, job: str) -> JobProgress | None:
        """A job's attempts, oldest first; None for a job this namespace never reported."""

    async def recent_progress(self, *, namespace: str | None, since: float,
                              limit: int) -> list[JobProgress]:
        """Up to `limit` jobs of `namespace` (None: every namespace) that reported at or
        after `since` (server clock), the latest first."""
        return await self.jobs_progress(await self.recent_progress_stamps(
            namespace=namespace, since=since, limit=limit))

    @abstractmethod
    async def recent_progress_stamps(self, *, namespace: str | None, since: float,
                                     limit: int, per_namespace: bool = False
                                     ) -> list[tuple[str, str, float]]:
        """(namespace, job, last_seen) of what `recent_progress` would return, without the
        summaries: a reader that kept a job's summary from a read at the same last_seen
        need not read it again (every write of a job sets its last_seen). With
        `per_namespace` (and namespace None), each namespace's own latest `limit`: the
        operator's views give each tenant its share, and one tenant that posts a thousand
        jobs cannot push another's out (#58)."""

    @abstractmethod
    async def jobs_progress(self, jobs: list[tuple[str, str, float]]) -> list[JobProgress]:
        """The jobs' attempts (given as (namespace, job, last_seen)), in the order given;
        a job with no attempts left is left out."""

    @abstractmethod
    async def attempt_stamps(self, jobs: list[tuple[str, str]]
                             ) -> dict[tuple[str, str], JobStamps]:
        """Each job's `progress.JobStamps` (given as (namespace, job); a job with no
        attempts is left out), without reading summaries: while a job heartbeats only its
        last attempt changes, and a reader that kept the rest need read only that one."""

    @abstractmethod
    async def attempts_progress(self, wanted: list[AttemptKey]
                                ) -> dict[AttemptKey, AttemptProgress]:
        """The summaries of the `wanted` attempts (those still kept)."""

    @abstractmethod
    async def prune_progress(self, before: float) -> int:
        """Drop jobs that have not reported since `before`; how many went."""
