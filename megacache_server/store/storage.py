"""The storage a running app serves from: a blob store and an index, built from settings."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from megacache_server.settings import Settings
from megacache_server.store.blobstore.base import BlobStore
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


BLOB_STORES = {"fs": "fs:FsBlobStore", "s3": "s3:S3BlobStore"}
"""Every blob store `MEGACACHE_BLOB_STORE` names: its module under `store/blobstore/` and its
class, which builds itself from settings (`BlobStore.from_settings`). A module is imported
only when chosen: a local-disk server never loads the S3 one. A new backend is its module,
a line here, and its name among the choices of `Settings.blob_store`."""


def build_storage(settings: Settings) -> Storage:
    return Storage(build_blob_store(settings),
                   build_index(settings.index_url(), redis_prefix=settings.redis_prefix))


def build_blob_store(settings: Settings) -> BlobStore:
    module, _, name = BLOB_STORES[settings.blob_store].partition(":")
    store: type[BlobStore] = getattr(
        importlib.import_module(f"megacache_server.store.blobstore.{module}"), name)
    return store.from_settings(settings)


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
