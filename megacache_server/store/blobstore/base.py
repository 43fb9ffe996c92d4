"""The blob store interface: immutable bytes addressed by their sha256.

A store must never make bytes visible under an address they do not hash to, and never
show a partial blob. Each backend does that its own way (temp file + rename, temp key +
copy); the digest check itself is shared here so every backend enforces the same rule.
"""

from __future__ import annotations

import asyncio
import hashlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from megacache_server.errors import BadRequest
from megacache_server.settings import Settings

READ_CHUNK = 1024 * 1024
"""Large chunks both ways: fewer thread hops and syscalls per byte served."""
DELETE_CONCURRENCY = 8
"""Deletes in flight at once where a store has no batch delete (at most the S3 client's
connection pool)."""


class DigestVerifier:
    """Hashes and counts bytes as they stream in; `check()` says whether they may be committed."""

    def __init__(self, digest: str, expected_size: int) -> None:
        self.digest = digest
        self.expected_size = expected_size
        self.received = 0
        self._sha = hashlib.sha256()

    def update(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.expected_size:
            raise BadRequest(
                f"body is longer than Content-Length {self.expected_size}", code="size_mismatch"
            )
        self._sha.update(data)

    def check(self) -> None:
        if self.received != self.expected_size:
            raise BadRequest(
                f"truncated upload: got {self.received} of {self.expected_size} bytes",
                code="truncated",
            )
        actual = self._sha.hexdigest()
        if actual != self.digest:
            raise BadRequest(
                f"digest mismatch: body hashes to {actual}, not {self.digest}",
                code="digest_mismatch",
                actual=actual,
            )


class BlobStore(ABC):
    """Content-addressed bytes. Digests passed in are already validated as 64 lowercase hex."""

    name: str = "abstract"

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: Settings) -> BlobStore:
        """The store as the server's settings configure it (`store.storage.BLOB_STORES`
        names the class for each `MEGACACHE_BLOB_STORE`)."""

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect or create what the store needs; called once at app start."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; called once at app stop."""

    @abstractmethod
    async def stat(self, digest: str) -> int | None:
        """Size of a stored blob, or None when absent."""

    @abstractmethod
    async def put(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool:
        """Store `body` under `digest` if it hashes to it. True if new, False if it existed.

        Raises BadRequest on mismatch or truncation, InsufficientStorage when out of room;
        in every failure case nothing is left behind.
        """

    @abstractmethod
    def read(self, digest: str, start: int = 0, end: int | None = None) -> AsyncIterator[bytes]:
        """Bytes [start, end) of a blob in large chunks. The caller has checked it exists."""

    @abstractmethod
    async def delete(self, digest: str) -> bool:
        """Remove a blob; True if it was there."""

    async def delete_many(self, digests: list[str]) -> set[str]:
        """Remove many blobs (GC deletes thousands at a time); returns the digests it could
        not remove, so the caller keeps their records. A blob already gone is removed.
        Stores with a batch call override this; the default runs a few deletes at once."""
        limit = asyncio.Semaphore(DELETE_CONCURRENCY)
        failed: set[str] = set()

        async def one(digest: str) -> None:
            async with limit:
                try:
                    await self.delete(digest)
                except Exception:  # the record stays; the next GC tries again
                    failed.add(digest)

        await asyncio.gather(*(one(d) for d in digests))
        return failed

    @abstractmethod
    def digests(self) -> AsyncIterator[tuple[str, int]]:
        """Every stored blob as (digest, size): for consistency checks and garbage collection."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise if the store cannot serve requests (readiness)."""

    # -- optional abilities: a default that means "not supported" -------------------------
    async def quarantine(self, digest: str, reason: str) -> bool:
        """Take a blob whose bytes are bad out of service: never served again under its
        address, kept aside for inspection where the store has room for that. True if there
        was a blob to take. The default has nowhere to keep it and deletes it."""
        return await self.delete(digest)

    def presigned_url(self, digest: str) -> str | None:
        """A time-limited URL a client can read the blob from without this server, or None
        where the store cannot sign one (then the server streams the bytes itself)."""
        return None
