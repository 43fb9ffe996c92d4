"""Blob store on a local directory: the embedded default.

Layout: `<root>/cas/ab/abcdef…` for blobs, `<root>/tmp/*.part` for uploads in flight.
An upload is written to its own temp file while hashing, fsynced, then hard-linked into
place: `link` fails if the address already exists, so concurrent uploads of one blob end
with exactly one copy and an exact created/existed answer, and a reader can never see a
partial file. The temp file is removed on every path, success or failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from anyio import to_thread

from megacache_server.blobstore.base import READ_CHUNK, BlobStore, DigestVerifier
from megacache_server.errors import InsufficientStorage, ServiceUnavailable

STALE_TEMP_AGE_S = 3600
"""Temp files older than this at start-up belong to a crashed upload and are removed."""


class FsBlobStore(BlobStore):
    name = "fs"

    def __init__(self, root: Path, min_free_bytes: int = 0) -> None:
        self.root = Path(root)
        self.cas_dir = self.root / "cas"
        self.tmp_dir = self.root / "tmp"
        self.min_free_bytes = min_free_bytes

    async def open(self) -> None:
        await to_thread.run_sync(self._open_sync)

    def _open_sync(self) -> None:
        self.cas_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        cutoff = time.time() - STALE_TEMP_AGE_S
        for part in self.tmp_dir.glob("*.part"):
            with contextlib.suppress(FileNotFoundError):
                if part.stat().st_mtime < cutoff:
                    part.unlink()

    def path_of(self, digest: str) -> Path:
        return self.cas_dir / digest[:2] / digest

    async def stat(self, digest: str) -> int | None:
        try:
            return (await to_thread.run_sync(os.stat, self.path_of(digest))).st_size
        except FileNotFoundError:
            return None

    async def put(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool:
        await to_thread.run_sync(self._check_room, size)
        verifier = DigestVerifier(digest, size)
        tmp = self.tmp_dir / f"{digest[:16]}-{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                buffer = bytearray()
                async for chunk in body:
                    buffer += chunk
                    if len(buffer) >= READ_CHUNK:
                        await to_thread.run_sync(_write_hashed, f, verifier, bytes(buffer))
                        buffer.clear()
                if buffer:
                    await to_thread.run_sync(_write_hashed, f, verifier, bytes(buffer))
                verifier.check()
                await to_thread.run_sync(_flush_and_sync, f)
            return await to_thread.run_sync(self._commit, tmp, self.path_of(digest))
        except OSError as exc:
            raise _storage_error(exc) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _check_room(self, size: int) -> None:
        free = shutil.disk_usage(self.root).free
        if free - size < self.min_free_bytes:
            raise InsufficientStorage(
                f"disk has {free} bytes free; storing {size} more would leave less than the "
                f"reserve of {self.min_free_bytes}",
                code="disk_full",
            )

    def _commit(self, tmp: Path, final: Path) -> bool:
        final.parent.mkdir(exist_ok=True)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        _fsync_dir(final.parent)
        return True

    async def read(
        self, digest: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """The bytes [start, end) in READ_CHUNK pieces, one worker-thread hop per piece.

        A hop to the thread pool costs more CPU than reading a cached MiB, so the open
        rides along with the first read, reads are positioned (no seek hop), and the close
        runs on the event loop (closing a read-only descriptor does no I/O): a blob of one
        chunk costs one hop instead of four.
        """
        offset = start
        fd, chunk = await to_thread.run_sync(self._open_and_read, self.path_of(digest),
                                             offset, self._want(offset, end))
        try:
            while chunk:
                offset += len(chunk)
                yield chunk
                want = self._want(offset, end)
                if not want:
                    break
                chunk = await to_thread.run_sync(os.pread, fd, want, offset)
        finally:
            os.close(fd)

    @staticmethod
    def _want(offset: int, end: int | None) -> int:
        return READ_CHUNK if end is None else max(0, min(READ_CHUNK, end - offset))

    @staticmethod
    def _open_and_read(path: Path, offset: int, want: int) -> tuple[int, bytes]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return fd, os.pread(fd, want, offset) if want else b""
        except BaseException:
            os.close(fd)
            raise

    async def delete(self, digest: str) -> bool:
        try:
            await to_thread.run_sync(os.unlink, self.path_of(digest))
            return True
        except FileNotFoundError:
            return False

    async def digests(self) -> AsyncIterator[tuple[str, int]]:
        for entry in await to_thread.run_sync(self._scan):
            yield entry

    def _scan(self) -> list[tuple[str, int]]:
        found = []
        for shard in sorted(self.cas_dir.iterdir()):
            if shard.is_dir():
                for blob in sorted(shard.iterdir()):
                    with contextlib.suppress(FileNotFoundError):
                        found.append((blob.name, blob.stat().st_size))
        return found

    async def ping(self) -> None:
        ok = await to_thread.run_sync(lambda: os.access(self.cas_dir, os.W_OK | os.X_OK))
        if not ok:
            raise ServiceUnavailable(f"blob directory {self.cas_dir} is not writable",
                                     code="store_unavailable")


def _write_hashed(f: BinaryIO, verifier: DigestVerifier, data: bytes) -> None:
    verifier.update(data)
    f.write(data)


def _flush_and_sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _storage_error(exc: OSError) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(f"blob store is full: {exc.strerror}", code="disk_full")
    return ServiceUnavailable(f"blob store I/O error: {exc}", code="store_unavailable")
