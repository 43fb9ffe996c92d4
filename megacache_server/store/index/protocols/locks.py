"""Locks: named, shared by every replica."""

from __future__ import annotations

from abc import ABC, abstractmethod


class LockStore(ABC):
    """Named locks shared by every replica."""

    @abstractmethod
    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        """Take a named lock shared by every replica (True if taken); it expires after ttl."""

    @abstractmethod
    async def release_lock(self, name: str) -> None:
        """Release a lock this process took."""
