"""Trust: quarantined blobs, entries torch could not load, and the scrub's order."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from megacache_server.store.index.protocols.blobs import BlobRecord


@dataclass(frozen=True)
class QuarantineRecord:
    """A blob taken out of service (or, with `digest` "", an entry withdrawn because torch
    repeatedly failed to load it): what was wrong, found by whom, and what stopped being
    offered because of it."""

    digest: str
    reason: str  # what the server found: digest, size, missing; or load (an entry)
    detail: str
    reporter: str  # a token's name, "scrub", or "anonymous" (auth off)
    at: float
    size: int
    namespaces: tuple[str, ...]  # the blob's owners (or the entry's namespace)
    withdrawn: tuple[str, ...]  # "namespace/key" of each entry no longer offered
    reporter_namespace: str = ""
    """The reporting token's namespace; "" for the scrub, auth off, and records older than
    this field. A reader of another namespace is never shown the reporter or the detail."""


MAX_QUARANTINE_RECORDS = 10_000
"""Quarantine records kept for inspection (the oldest go first; counts by reason stay)."""


class TrustStore(ABC):
    """What keeps bad bytes from being served again: quarantined blobs (why, when, who
    reported), reports of entries torch could not load, and when each blob was last
    re-hashed (the scrub's order)."""

    @abstractmethod
    async def entries_naming(self, digest: str) -> list[str]:
        """The keys of every entry that names the blob."""

    @abstractmethod
    async def blob_namespaces(self, digest: str) -> list[str]:
        """The namespaces that uploaded the blob."""

    @abstractmethod
    async def add_quarantine(self, record: QuarantineRecord) -> None:
        """Keep a quarantine record and count it under its reason (counts never go down)."""

    @abstractmethod
    async def quarantines(self, *, namespace: str | None, limit: int
                          ) -> list[QuarantineRecord]:
        """The newest records first, those touching `namespace` only (None: all)."""

    @abstractmethod
    async def quarantine_counts(self) -> dict[str, int]:
        """Quarantines ever made, by reason."""

    @abstractmethod
    async def quarantined(self, digests: list[str]) -> set[str]:
        """Which of `digests` were quarantined (and not uploaded again since)."""

    @abstractmethod
    async def clear_quarantined(self, digest: str) -> None:
        """The blob was uploaded again, verified: it may be offered once more."""

    @abstractmethod
    async def add_load_report(self, key: str, etag: str, reporter: str, now: float) -> int:
        """Note that `reporter` could not load this version of the entry; how many distinct
        reporters have said so of this version."""

    @abstractmethod
    async def mark_verified(self, digest: str, at: float) -> None:
        """The blob's bytes were re-hashed and found good at `at`."""

    @abstractmethod
    async def least_verified(self, limit: int) -> list[tuple[BlobRecord, float]]:
        """Recorded blobs with when they were last verified, longest ago first (a blob is
        verified when uploaded; 0 for records older than this bookkeeping)."""


def newest_touching(records: Iterable[QuarantineRecord], namespace: str | None,
                    limit: int) -> list[QuarantineRecord]:
    """The first `limit` of `records` (given newest first) that touch `namespace` (None:
    all): the one rule of `TrustStore.quarantines` for backends that filter as they read."""
    return list(islice((r for r in records if namespace is None or namespace in r.namespaces),
                       limit))
