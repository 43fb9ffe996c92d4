"""What can go wrong talking to the server, as exception types the session sorts into outcomes.

`CorruptBlobError` (and its kind) mean the cache held bad bytes: the run reports `invalid`.
Everything else that is a `TransportError` means the server could not be used: `error`.
"""

from __future__ import annotations


class TransportError(Exception):
    """The server could not be used for this request; `status` is the HTTP status if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CircuitOpenError(TransportError):
    """The breaker is open: the server failed recently, so we do not wait on it again."""


class DeadlineExceeded(TransportError):
    """The step's total time budget ran out before the server answered."""


class CorruptBlobError(TransportError):
    """Downloaded bytes do not hash to their address: never loaded, reported as invalid."""


class UntrustedEntryError(CorruptBlobError):
    """A manifest without a valid server signature, when the client requires one."""
