"""What a prefetch leaves for the load (`PrefetchResult`) and how the load reads a prefetch
still running (`Prefetching`).

Below `prefetch.py`, `fetch.py` and `load.py` alike: the prefetch thread fetches and places
with the steps' own helpers, and the steps take what it left, without either importing the
other's module (no circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from megacache_client.transport.trust import ServedEntry


@dataclass
class PrefetchResult:
    """What the prefetch left in the node cache, and how it went."""

    paths: dict[str, Path] = field(default_factory=dict)
    """digest -> verified local path, for every blob fetched or found on disk."""
    placed: dict[str, int] = field(default_factory=dict)
    """digest -> files unpacked from that kernels/toolchain pack."""
    bundles: dict[str, bytes] = field(default_factory=dict)
    """digest -> the Mega-Cache bundle, decompressed and checked (`read_bundle`): the load
    hands it to torch without reading, decompressing or hashing it again."""
    bytes_down: int = 0
    """Downloaded before `wait` returns (the toolchain pack counts in `toolchain_bytes`)."""
    toolchain_bytes: int = 0
    seconds: float = 0.0
    error: str = ""
    entry_key: str | None = None
    entry: ServedEntry | None = None
    """The configured model's newest entry, read by key as the load reads an exact hit
    (through the gate, access recorded): a load whose fingerprint is this key uses it
    instead of asking again."""
    toolchain: str | None = None
    """Digest of the toolchain pack this prefetch downloads and places *after* the rest is
    ready (`Prefetcher.wait`): the first compile loads the bundle and graphs while ~150 MB
    of headers are unpacked, and waits for them only at torch's header."""
    toolchain_error: str = ""


class Prefetching(Protocol):
    """A prefetch as the load reads it (`prefetch.Prefetcher`)."""

    @property
    def result(self) -> PrefetchResult:
        """What it left so far (complete once `wait` returned it)."""

    @property
    def previous(self) -> Prefetching | None:
        """The earlier prefetch of this process it continued, if any."""

    def wait(self, timeout: float) -> PrefetchResult | None:
        """The result once the downloads have finished, or None if still running."""

    def wait_toolchain(self, timeout: float) -> bool:
        """Wait for the toolchain pack to be in place (after `wait`); False on timeout."""
