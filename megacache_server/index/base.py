"""The index interface: fingerprint key → manifest, plus what the store knows of its blobs.

The index is the service's metadata: entries (the action cache), the size of every blob
committed to the CAS (for the store budget and, later, eviction), and nothing else. Blob
bytes live in a BlobStore.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

from megacache_client.events import OUTCOMES, Event
from megacache_server.errors import PreconditionFailed


@dataclass(frozen=True)
class StoredEntry:
    key: str
    manifest_json: bytes
    etag: str
    created_at: float
    updated_at: float
    last_access: float
    pinned: bool = False


@dataclass(frozen=True)
class BlobRecord:
    """What the index knows of a committed blob; `touched_at` guards it from early GC."""

    digest: str
    size: int
    touched_at: float


@dataclass(frozen=True)
class TokenRecord:
    """A bearer token as stored: only its hash, never the token itself."""

    token_id: str
    name: str
    token_hash: str
    scopes: tuple[str, ...]
    namespace: str
    created_at: float
    revoked: bool = False
    expires_at: float | None = None  # epoch seconds; None: never

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True)
class Precondition:
    """HTTP conditional-request headers for an entry write (RFC 9110 §13)."""

    if_match: str | None = None
    if_none_match: str | None = None


@dataclass
class ModelStats:
    model: str
    runs: int = 0
    outcomes: dict[str, int] | None = None
    compile_s: float = 0.0
    saved_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0

    def __post_init__(self) -> None:
        if self.outcomes is None:
            self.outcomes = dict.fromkeys(OUTCOMES, 0)

    @property
    def hit_rate(self) -> float:
        """Runs that started warm (exact or fallback) over all runs."""
        assert self.outcomes is not None
        warm = self.outcomes["hit"] + self.outcomes["fallback"]
        return warm / self.runs if self.runs else 0.0


class Index(ABC):
    name: str = "abstract"

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect or create schema; called once at app start."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; called once at app stop."""

    @abstractmethod
    async def get(self, key: str, *, touch: bool = True) -> StoredEntry | None:
        """The entry for `key`; `touch` records the access for LRU eviction."""

    @abstractmethod
    async def put(
        self,
        key: str,
        manifest_json: bytes,
        *,
        model: str,
        env_digest: str,
        hw_digest: str,
        blob_digests: list[str],
        created_at: float,
        condition: Precondition,
        namespace: str = "default",
    ) -> tuple[StoredEntry, bool]:
        """Write an entry atomically with its precondition; returns (entry, created).

        Raises PreconditionFailed when the condition does not hold at write time.
        """

    @abstractmethod
    async def list_entries(
        self, *, model: str | None, env_digest: str | None, hw_digest: str | None, limit: int,
        namespace: str | None = None,
    ) -> list[StoredEntry]:
        """Entries matching every given filter, newest (by manifest created_at) first."""

    @abstractmethod
    async def entry_count(self) -> int:
        """How many entries there are (without loading them)."""

    @abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove an entry; True if it was there."""

    @abstractmethod
    async def record_blob(self, digest: str, size: int) -> None:
        """Note a blob committed to the CAS (idempotent)."""

    @abstractmethod
    async def stored_bytes(self) -> int:
        """Total size of recorded blobs: what the store budget is checked against."""

    @abstractmethod
    async def set_pinned(self, key: str, pinned: bool) -> bool:
        """Pin (never evict) or unpin an entry; False if there is no such entry."""

    @abstractmethod
    async def lru_entries(self, limit: int) -> list[StoredEntry]:
        """Unpinned entries, least recently accessed first: eviction candidates."""

    @abstractmethod
    async def blob_records(self) -> list[BlobRecord]:
        """Every blob the index has recorded."""

    @abstractmethod
    async def blob_record(self, digest: str) -> BlobRecord | None:
        """One blob's record, or None."""

    @abstractmethod
    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        """Take a named lock shared by every replica (True if taken); it expires after ttl."""

    @abstractmethod
    async def release_lock(self, name: str) -> None:
        """Release a lock this process took."""

    @abstractmethod
    async def referenced(self, digests: list[str]) -> set[str]:
        """Which of `digests` some entry names."""

    @abstractmethod
    async def touch_blobs(self, digests: list[str]) -> None:
        """Mark blobs as just used (a manifest naming them is being written)."""

    @abstractmethod
    async def forget_blob(self, digest: str) -> None:
        """Drop a blob's record after the store deleted it."""

    @abstractmethod
    async def own_blob(self, namespace: str, digest: str) -> bool:
        """Record that `namespace` stored this blob; True if it had not before."""

    @abstractmethod
    async def owns_blob(self, namespace: str, digest: str) -> bool:
        """Whether `namespace` may see this blob (the CAS dedupes bytes across namespaces)."""

    @abstractmethod
    async def put_token(self, token: TokenRecord) -> None:
        """Store a new token record."""

    @abstractmethod
    async def get_token(self, token_id: str) -> TokenRecord | None:
        """A token record by id (revoked ones included)."""

    @abstractmethod
    async def list_tokens(self) -> list[TokenRecord]:
        """Every token record, oldest first."""

    @abstractmethod
    async def revoke_token(self, token_id: str) -> bool:
        """Revoke a token; False if there is no such token."""

    @abstractmethod
    async def add_event(self, event: Event) -> None:
        """Store one client run's event (for stats, metrics and the dashboard)."""

    @abstractmethod
    async def events_since(self, since: float, limit: int) -> list[Event]:
        """Events at or after `since` (epoch seconds), newest first, at most `limit`."""

    @abstractmethod
    async def stats(self, *, since: float | None = None) -> list[ModelStats]:
        """Per-model aggregates of the events since `since` (epoch seconds), busiest first."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise if the index cannot serve requests (readiness)."""


def check_precondition(condition: Precondition, current_etag: str | None) -> None:
    """Shared by every backend so they agree on conditional-write semantics."""
    if condition.if_match is not None:
        tags = _tags(condition.if_match)
        if current_etag is None or ("*" not in tags and current_etag not in tags):
            raise PreconditionFailed(
                "If-Match does not match the current entry", current_etag=current_etag
            )
    if condition.if_none_match is not None:
        tags = _tags(condition.if_none_match)
        if current_etag is not None and ("*" in tags or current_etag in tags):
            raise PreconditionFailed(
                "If-None-Match: the entry already exists", current_etag=current_etag
            )


def _tags(header: str) -> set[str]:
    return {t.strip().removeprefix("W/") for t in header.split(",") if t.strip()}


def entry_etag(manifest_json: bytes) -> str:
    """A strong ETag for an entry: changes whenever its stored manifest bytes change."""
    return '"' + hashlib.sha256(manifest_json).hexdigest()[:32] + '"'


def aggregate_stats(
    rows: list[tuple[str, str, int, float, float, int, int]],
) -> list[ModelStats]:
    """Fold (model, outcome, count, compile_s, saved_s, bytes_down, bytes_up) rows per model."""
    by_model: dict[str, ModelStats] = {}
    for model, outcome, count, compile_s, saved_s, down, up in rows:
        s = by_model.setdefault(model, ModelStats(model))
        assert s.outcomes is not None
        s.runs += count
        s.outcomes[outcome] = s.outcomes.get(outcome, 0) + count
        s.compile_s += compile_s or 0.0
        s.saved_s += saved_s or 0.0
        s.bytes_down += down or 0
        s.bytes_up += up or 0
    return sorted(by_model.values(), key=lambda s: (-s.runs, s.model))
