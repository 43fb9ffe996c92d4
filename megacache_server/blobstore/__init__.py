"""Blob store backends, chosen by settings."""

from megacache_server.blobstore.base import BlobStore, DigestVerifier

__all__ = ["BlobStore", "DigestVerifier"]
