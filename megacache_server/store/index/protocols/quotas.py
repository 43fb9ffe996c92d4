"""Quotas: holds on a namespace's pending bytes while its uploads stream."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingHold:
    """The answer to a hold on a namespace's pending quota, and what the quota stood at."""

    granted: bool
    pending: int  # bytes of blobs the namespace uploaded that none of its entries names
    held: int  # bytes the namespace's other live holds keep (uploads in flight)


class QuotaStore(ABC):
    """Holds on a namespace's pending quota, shared by every worker and replica: an upload
    holds its bytes while it streams, so N connections to N processes cannot each pass the
    quota. A hold lives until released or until its time runs out (a worker that crashes
    mid-upload holds nothing for long); the uploader renews it while bytes arrive."""

    @abstractmethod
    async def hold_pending(self, namespace: str, hold_id: str, size: int, cap: int,
                           ttl_s: float, now: float) -> PendingHold:
        """Hold `size` bytes of `namespace`'s pending quota under `hold_id` until
        `now + ttl_s`, if `pending_bytes(namespace)`, the bytes of the namespace's other
        live holds and `size` fit in `cap` (else nothing is held: granted False). A live
        hold of that id is renewed instead, whatever the cap. Atomic across processes and
        replicas (a transaction, a script): two holds decided at once never both pass on
        the same room. Holds past their time are dropped before deciding."""

    @abstractmethod
    async def release_pending(self, namespace: str, hold_id: str) -> None:
        """Drop a hold (nothing to do if it lapsed)."""
