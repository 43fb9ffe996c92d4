"""What a session's steps produce: the records the lifecycle, the load, the publish and the
report pass between them, kept apart so that each of those modules can import them without
importing the others."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megacache_client.wire.events import Outcome
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest


@dataclass(frozen=True)
class ServedEntry:
    """A manifest the gate let through, with what proved it: made only by
    `transport.trust.Gate.entry`."""

    manifest: Manifest
    etag: str
    provenance: str | None
    asked: str
    """The key the client asked for (a fallback answers with another key's manifest)."""

    @property
    def key(self) -> str:
        return self.manifest.key


@dataclass(frozen=True)
class Admitted:
    """One blob of a `ServedEntry`, on local disk, verified: made only by `Gate.admit`."""

    entry: ServedEntry
    ref: BlobRef
    path: Path


@dataclass
class LoadResult:
    outcome: Outcome | None = None
    key: str | None = None
    served: ServedEntry | None = None
    """The entry chosen for this fingerprint, as the gate let it through."""
    bundle: Admitted | None = None
    """Its Mega-Cache bundle as the gate admitted it (a republish reads it again)."""
    differing: list[str] = field(default_factory=list)
    reason: str = ""
    bytes_down: int = 0
    loaded_keys: set[tuple[str, str]] = field(default_factory=set)
    placed: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)
    precompile: str = ""
    """Why the entry's precompiled Dynamo output was not loaded ("" when loaded or absent)."""
    withheld: set[tuple[str, str]] = field(default_factory=set)
    """The (type, key) of the bundle's artifacts compiled for another rank of a job
    (`torch/ranks.py`): never handed to torch here, kept in any entry this run rewrites."""
    job_note: str = ""
    """Why this process of a job decided alone ("" when the job's resolution decided)."""
    untrusted_etag: str = ""
    """The version of this key's entry refused for its writer (`MEGACACHE_TRUSTED_WRITERS`):
    only a trusted writer publishes over it."""
    reported: str = ""
    """The server's verdict on the bad bytes this load met and reported (or why the report
    did not go out); "" when there was nothing to report."""

    @property
    def entry(self) -> Manifest | None:
        return self.served.manifest if self.served is not None else None

    @property
    def etag(self) -> str | None:
        return self.served.etag if self.served is not None else None

    def timer(self) -> Callable[[str], None]:
        """Returns `mark(name)`: records the seconds since the previous mark under `name`."""
        last = [time.monotonic()]

        def mark(name: str) -> None:
            now = time.monotonic()
            self.steps[name] = round(now - last[0], 4)
            last[0] = now

        return mark


@dataclass
class PublishResult:
    published: bool = False
    reason: str = ""
    bytes_up: int = 0
    key: str | None = None
    etag: str | None = None
    """The version of the entry this process wrote last (a later round replaces it)."""
    merged: bool = False
    """This process added to another publisher's entry (a later round adds again, never
    replaces theirs with ours)."""
    shipped: set[tuple[str, str]] = field(default_factory=set)
    """The artifact keys (type, key) of what this process's rounds shipped so far."""
    shipped_kernels: set[str] = field(default_factory=set)
    rounds: int = 0
    """Publish rounds that wrote this track's entry."""


@dataclass
class Track:
    """One fingerprint this process compiled under: its entry's load and its publish."""

    fp: Fingerprint
    load: LoadResult
    publish: PublishResult = field(default_factory=PublishResult)


@dataclass
class Snapshot:
    """This run's artifacts, taken once, and the tracks whose entries lack some of them."""

    raw: bytes
    counts: dict[str, int]
    kernels: dict[str, Path]
    compile_s: float
    tracks: list[Track]
    keys: set[tuple[str, str]] = field(default_factory=set)
    """The (type, key) of every artifact torch had recorded when it was taken."""
    kernel_ids: set[str] = field(default_factory=set)
    """The path-free identities of its kernels."""
    meta: dict[str, str] = field(default_factory=dict)
    """What its bundle blob records about its precompile artifacts (`precompile.producer_meta`:
    which torch made them, which were verified)."""
