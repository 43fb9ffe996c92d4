"""The storage a running app serves from: a blob store and an index, built from settings."""

from __future__ import annotations

import contextlib
import importlib
import shutil
from collections.abc import Iterator
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
    with_blobs: bool = True
    """False for a command that needs the index alone (tokens): the blob store is then
    neither opened nor created."""

    async def open(self) -> None:
        await self.index.open()
        if self.with_blobs:
            try:
                await self.blobs.open()
            except BaseException:
                await self.index.close()
                raise

    async def close(self) -> None:
        await self.index.close()
        if self.with_blobs:
            await self.blobs.close()


BLOB_STORES = {"fs": "fs:FsBlobStore", "s3": "s3:S3BlobStore"}
"""Every blob store `MEGACACHE_BLOB_STORE` names: its module under `store/blobstore/` and its
class, which builds itself from settings (`BlobStore.from_settings`). A module is imported
only when chosen: a local-disk server never loads the S3 one. A new backend is its module,
a line here, and its name among the choices of `Settings.blob_store`."""


def build_storage(settings: Settings, *, with_blobs: bool = True) -> Storage:
    return Storage(build_blob_store(settings),
                   build_index(settings.index_url(), redis_prefix=settings.redis_prefix),
                   with_blobs)


def local_paths(settings: Settings, *, with_blobs: bool = True) -> list[Path]:
    """What opening this storage may create on local disk: an `fs` blob store's data dir
    and an SQLite index's file with its WAL and shared-memory files."""
    paths = [settings.data_dir] if with_blobs and settings.blob_store == "fs" else []
    url = settings.index_url()
    if urlparse(url).scheme == "sqlite":
        db = Path(_sqlite_path(url))
        paths += [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    return paths


@contextlib.contextmanager
def removed_on_failure(paths: list[Path]) -> Iterator[None]:
    """A block that fails creates nothing: whichever of `paths` (with the folders above them
    that were missing too) did not exist before it is removed again when it raises, so a
    command run against a store that is down, or refused, leaves no empty data dir behind.
    What existed before is never touched."""
    new = {top for path in paths if (top := _first_missing(path)) is not None}
    try:
        yield
    except BaseException:
        for path in new:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        raise


def _first_missing(path: Path) -> Path | None:
    """The topmost of `path` and its parents that does not exist; None if `path` does."""
    path = path.absolute()
    if path.exists() or path.is_symlink():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


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
