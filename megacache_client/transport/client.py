"""HTTP to the megacache server, with the manners a trainer needs: `RemoteCache`.

`RemoteCache` is the v1 HTTP API as Python calls, composed of its parts by what they talk
to, each a subclass of the one exchange (`exchange.Exchange`: the HTTP client, retries,
breaker, deadlines, the capped reader): the entries (`entries.py`, handed out only through
the trust gate), the blobs (`blobs.py`, streamed, resumed, verified) and the job side
(`reporting.py`: findings, events, progress, stats, ETT). A caller holds one object and
imports it from here, with the names its calls raise and take.
"""

from __future__ import annotations

from megacache_client.errors import (
    CircuitOpenError,
    CorruptBlobError,
    DeadlineExceeded,
    TransportError,
    UntrustedEntryError,
    UntrustedWriterError,
)
from megacache_client.transport.blobs import BlobRoutes, ByteProgress
from megacache_client.transport.breaker import CircuitBreaker, breaker_for
from megacache_client.transport.entries import EntryRoutes, ResolutionUnsupported
from megacache_client.transport.exchange import Answer, producer_headers
from megacache_client.transport.reporting import ReportingRoutes
from megacache_client.transport.retry import Deadline
from megacache_client.transport.trust import ServedEntry
from megacache_client.wire.manifest import sha256_file

__all__ = ["Answer", "ByteProgress", "CircuitBreaker", "CircuitOpenError", "CorruptBlobError",
           "Deadline", "DeadlineExceeded", "RemoteCache", "ResolutionUnsupported",
           "ServedEntry", "TransportError", "UntrustedEntryError", "UntrustedWriterError",
           "breaker_for", "producer_headers", "sha256_file"]


class RemoteCache(EntryRoutes, BlobRoutes, ReportingRoutes):
    """The v1 HTTP API as Python calls. Raises TransportError; never hangs past its
    deadline, and never holds more of an answer in memory than its endpoint's cap."""
