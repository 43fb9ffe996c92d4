"""The storage a running app serves from: a blob store and an index, built from settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from megacache_server.settings import Settings
from megacache_server.store.blobstore.base import BlobStore
from megacache_server.store.blobstore.fs import FsBlobStore
from megacache_server.store.index.base import Index
from megacache_server.store.index.sqlite import SqliteIndex


@dataclass
class Storage:
    blobs: BlobStore
    index: Index

    async def open(self) -> None:
        await self.blobs.open()
        await self.index.open()

    async def close(self) -> None:
        await self.index.close()
        await self.blobs.close()


def build_storage(settings: Settings) -> Storage:
    return Storage(build_blob_store(settings),
                   build_index(settings.index_url(), redis_prefix=settings.redis_prefix))


def build_blob_store(settings: Settings) -> BlobStore:
    if settings.blob_store == "s3":
        from megacache_server.store.blobstore.s3 import S3BlobStore

        return S3BlobStore(
            settings.s3_bucket, settings.s3_prefix, endpoint_url=settings.s3_endpoint,
            region=settings.s3_region, access_key=settings.s3_access_key,
            secret_key=settings.s3_secret_key, create_bucket=settings.s3_create_bucket)
    return FsBlobStore(settings.data_dir, min_free_bytes=int(settings.min_free_disk))


def build_index(url: str, redis_prefix: str = "megacache:") -> Index:
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        return SqliteIndex(Path(_sqlite_path(url)))
    if parsed.scheme in ("redis", "rediss", "unix"):
        from megacache_server.store.index.redis import RedisIndex

        return RedisIndex(url, prefix=redis_prefix)
    raise ValueError(f"unsupported index URL {url!r}: expected sqlite:///path or redis://host")


def _sqlite_path(url: str) -> str:
    # sqlite:///relative/or/abs  → everything after the third slash is the path as written
    path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else url[len("sqlite://"):]
    return path or "index.sqlite3"
