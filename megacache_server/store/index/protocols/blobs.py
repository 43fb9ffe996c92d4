"""Blobs: which the CAS holds, their sizes, last touch and owning namespaces."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class BlobRecord:
    """What the index knows of a committed blob; `touched_at` guards it from early GC."""

    digest: str
    size: int
    touched_at: float


class BlobLedger(ABC):
    """Which blobs the CAS holds, their sizes, last touch and owning namespaces."""

    @abstractmethod
    async def record_blob(self, digest: str, size: int, namespace: str) -> bool:
        """Note a blob committed to the CAS for `namespace`; True if new to that namespace."""

    @abstractmethod
    async def stored_bytes(self) -> int:
        """Total size of recorded blobs: what the store budget is checked against."""

    @abstractmethod
    async def pending_bytes(self, namespace: str) -> int:
        """Bytes of blobs `namespace` uploaded that no entry of `namespace` names (yet).

        Another namespace's entries do not count: bytes a tenant uploads weigh the same on
        its quota whether or not some other tenant's entry names them, so the quota cannot
        tell it what others stored."""

    @abstractmethod
    async def recorded_digests(self) -> set[str]:
        """The digest of every blob the index has recorded (fsck compares them with the
        blob store), read in pages where the backend serves others meanwhile."""

    async def blob_record(self, digest: str) -> BlobRecord | None:
        """One blob's record, or None (backends with a faster point read override it)."""
        return (await self.blob_records_of([digest])).get(digest)

    @abstractmethod
    async def blob_records_of(self, digests: list[str]) -> dict[str, BlobRecord]:
        """The records of those of `digests` the index holds."""

    @abstractmethod
    async def unreferenced_blobs(self) -> list[BlobRecord]:
        """Every recorded blob that no entry names (GC's candidates), read in pages."""

    @abstractmethod
    async def reference_counts(self, digests: list[str]) -> dict[str, int]:
        """How many entries name each of `digests` (0 for none)."""

    async def referenced(self, digests: list[str]) -> set[str]:
        """Which of `digests` some entry names."""
        return {d for d, n in (await self.reference_counts(digests)).items() if n}

    @abstractmethod
    async def touch_blobs(self, digests: list[str]) -> None:
        """Mark blobs as just used (a manifest naming them is being written)."""

    @abstractmethod
    async def forget_blobs(self, digests: list[str]) -> None:
        """Drop blobs' records (and their owners) after the store deleted them."""

    async def forget_blob(self, digest: str) -> None:
        await self.forget_blobs([digest])

    @abstractmethod
    async def owns_blob(self, namespace: str, digest: str) -> bool:
        """Whether `namespace` may see this blob (the CAS dedupes bytes across namespaces)."""
