"""Entries: fingerprint key -> manifest (the action cache), the records written and read,
and the conditional-write rules every backend shares (`check_precondition`, `entry_etag`)."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from megacache_server.errors import PreconditionFailed


@dataclass(frozen=True)
class EntryInfo:
    """An entry without its manifest bytes: what eviction, quotas and dashboards need."""

    key: str
    namespace: str
    model: str
    digests: tuple[str, ...]
    size: int  # stored bytes of the blobs it names
    created_at: float
    updated_at: float
    last_access: float
    pinned: bool


@dataclass(frozen=True)
class StoredEntry(EntryInfo):
    manifest_json: bytes = b""
    etag: str = ""
    provenance: str = ""
    """Who wrote this version (`service.security.provenance`, canonical JSON); "" for entries
    written before provenance was recorded."""


@dataclass(frozen=True)
class NewEntry:
    """An entry to write: the validated manifest bytes and the columns derived from it."""

    key: str
    manifest_json: bytes
    namespace: str
    model: str
    env_digest: str
    hw_digest: str
    digests: tuple[str, ...]
    size: int
    created_at: float
    provenance: str = ""
    """Who wrote it (canonical JSON); the backend adds the version's `sequence` to it."""
    sequence_floor: int = 0
    """The lowest version number this write may get (the server's clock in ms): a key's
    versions count up from where the clock stands even once every record of it is gone."""


def sequenced(provenance: str, sequence: int) -> str:
    """`provenance` (canonical JSON, as `service.security.provenance` writes it) with `sequence`
    set: what an entry version is stored and served with ("" stays "")."""
    if not provenance:
        return ""
    return canonical(json.loads(provenance) | {"sequence": sequence})


def canonical(data: dict[str, Any]) -> str:
    """JSON as provenance is kept and signed: sorted keys, no spaces, ASCII."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class Precondition:
    """HTTP conditional-request headers for an entry write (RFC 9110 §13)."""

    if_match: str | None = None
    if_none_match: str | None = None


class EntryStore(ABC):
    """Fingerprint key -> manifest (the action cache), with what eviction, quotas and
    listings need already in columns (namespace, model, blob digests, size): nobody re-parses
    manifests to learn them."""

    @abstractmethod
    async def get(self, key: str, *, touch: bool = True) -> StoredEntry | None:
        """The entry for `key`; `touch` records the access for LRU eviction."""

    @abstractmethod
    async def touch(self, entry: StoredEntry) -> StoredEntry:
        """Record an access of `entry` for LRU eviction (the caller has checked that the
        reader may see it: a lookup from another namespace must not reorder eviction)."""

    @abstractmethod
    async def put(self, entry: NewEntry, condition: Precondition) -> tuple[StoredEntry, bool]:
        """Write an entry atomically with its precondition; returns (entry, created).

        The version gets its sequence number in the same atomic step: one above every
        number this key had before (across rewrites, deletes and re-creates, on every
        replica) and at least `entry.sequence_floor`, added to its provenance (`sequenced`)
        and kept for the key after the entry is gone. So the version that stands is always
        the highest-numbered one, and a client that has seen a number refuses an older
        version served later (a proxy replaying a superseded, validly signed manifest).
        Raises PreconditionFailed when the condition does not hold at write time.
        """

    @abstractmethod
    async def list_entries(self, *, namespace: str | None = None, model: str | None = None,
                           env_digest: str | None = None, hw_digest: str | None = None,
                           limit: int) -> list[StoredEntry]:
        """Entries matching every given filter, newest (by manifest created_at) first."""

    @abstractmethod
    async def entry_digests(self) -> dict[str, tuple[str, ...]]:
        """Every entry's key and the blobs it names: fsck's side of its check, and no more
        (at a million entries the rest of each entry is seconds of reading fsck discards)."""

    @abstractmethod
    async def largest_entries(self, *, namespace: str | None, limit: int) -> list[EntryInfo]:
        """The biggest entries by stored bytes."""

    @abstractmethod
    async def usage(self, namespace: str | None = None) -> tuple[int, int]:
        """(entries, bytes of their blobs) of a namespace, or of the whole store."""

    @abstractmethod
    async def delete(self, key: str, *, unless_pinned: bool = False) -> bool:
        """Remove an entry; True if it was there (and, with `unless_pinned`, not pinned)."""

    async def delete_unpinned(self, keys: list[str]) -> int:
        """Evict many entries, each only if it is still there and unpinned; how many went.
        Backends that can delete in batches override this."""
        return sum([await self.delete(key, unless_pinned=True) for key in keys])

    @abstractmethod
    async def set_pinned(self, key: str, pinned: bool) -> bool:
        """Pin (never evict) or unpin an entry; False if there is no such entry."""

    async def flush_access(self) -> None:  # noqa: B027 - optional hook
        """Write the access times a backend buffers, for a reader on another connection
        (the off-loop collector) to see the same LRU order."""

    @abstractmethod
    async def lru_entries(self, limit: int, *, namespace: str | None = None,
                          after: EntryInfo | None = None) -> list[EntryInfo]:
        """Unpinned entries, least recently accessed first, from the one after `after` (the
        last of the previous page): eviction candidates, read page by page."""


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
