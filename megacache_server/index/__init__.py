"""Index backends, chosen by settings."""

from megacache_server.index.base import Index, Precondition, StoredEntry

__all__ = ["Index", "Precondition", "StoredEntry"]
