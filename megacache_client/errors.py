"""The client's exception types: what can go wrong talking to the server, as types the
session sorts into outcomes, and the one error a trainer may see (`MegacacheError`).

`CorruptBlobError` (and its kind) mean the cache held bad bytes: the run reports `invalid`.
Everything else that is a `TransportError` means the server could not be used: `error`.
Neither reaches the trainer: only `MEGACACHE_MODE=required` raises, and then `MegacacheError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from megacache_client.wire.escape import escape

FindingKind = Literal["digest", "size", "decompress", "unpack", "load"]


@dataclass(frozen=True)
class Finding:
    """Bad bytes this client met, as the server hears of them (`report.send_finding`): the
    blob that failed (None when torch could not load an entry whose blobs all verified),
    the entry it came in, and what was wrong. One process pays the cold compile; the
    server re-verifies and stops serving the rot to the rest of the fleet."""

    kind: FindingKind
    digest: str | None = None
    entry_key: str | None = None
    detail: str = ""


class BadArtifact(Exception):
    """Base of the errors that mean the cache held bad bytes; `finding` names them once
    known (the raiser, or the step that knew which blob it was reading)."""

    finding: Finding | None = None


@contextlib.contextmanager
def blamed_on(kind: FindingKind, digest: str | None = None,
              entry_key: str | None = None) -> Iterator[None]:
    """Name what a `BadArtifact` raised inside was about (the raiser rarely knows which
    blob it was reading), unless the raiser already did."""
    try:
        yield
    except BadArtifact as exc:
        if exc.finding is None:
            exc.finding = Finding(kind, digest, entry_key, str(exc)[:500])
        raise


def exc_text(exc: BaseException) -> str:
    """An exception as a reason or a log line says it: its type and message, escaped
    (`wire.escape`): a network exception's message may quote what a server sent."""
    return escape(f"{type(exc).__name__}: {exc}".rstrip(": "), 1000)


class MegacacheError(RuntimeError):
    """Raised only in `required` mode, when the cache could not be used: the public one
    (`megacache_client.MegacacheError`)."""


class TransportError(Exception):
    """The server could not be used for this request; `status` is the HTTP status if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CircuitOpenError(TransportError):
    """The breaker is open: the server failed recently, so we do not wait on it again."""


class DeadlineExceeded(TransportError):
    """The step's total time budget ran out before the server answered."""


class CorruptBlobError(TransportError, BadArtifact):
    """Downloaded bytes do not hash to their address: never loaded, reported as invalid."""

    def __init__(self, message: str, status: int | None = None,
                 finding: Finding | None = None) -> None:
        super().__init__(message, status)
        self.finding = finding


class UntrustedEntryError(CorruptBlobError):
    """A manifest without a valid server signature, when the client requires one."""


class UntrustedWriterError(TransportError):
    """The entry's writer is not one this consumer trusts (`MEGACACHE_TRUSTED_WRITERS`): a
    miss, never loaded; `etag` is the version seen, which only a trusted writer replaces."""

    def __init__(self, message: str, key: str, etag: str) -> None:
        super().__init__(message)
        self.key, self.etag = key, etag
