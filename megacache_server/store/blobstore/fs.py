"""Blob store on a local directory: the embedded default.

Layout: `<root>/cas/ab/abcdef…` for blobs, `<root>/tmp/*.part` for uploads in flight,
`<root>/quarantine/abcdef…` (with `.reason`) for blobs found bad, kept for inspection.
An upload is written to its own temp file while hashing, fsynced, then hard-linked into
place: `link` fails if the address already exists, so concurrent uploads of one blob end
with exactly one copy and an exact created/existed answer, and a reader can never see a
partial file. The temp file is removed on every path, success or failure.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from anyio import to_thread

from megacache_server.errors import InsufficientStorage, ServiceUnavailable
from megacache_server.settings import Settings
from megacache_server.store.blobstore.base import READ_CHUNK, BlobStore, DigestVerifier

STALE_TEMP_AGE_S = 3600
"""Temp files older than this at start-up belong to a crashed upload and are removed."""


class FsBlobStore(BlobStore):
    name = "fs"

    def __init__(self, root: Path, min_free_bytes: int = 0) -> None:
        self.root = Path(root)
        self.cas_dir = self.root / "cas"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        self.min_free_bytes = min_free_bytes

    @classmethod
    def from_settings(cls, settings: Settings) -> FsBlobStore:
        return cls(settings.data_dir, min_free_bytes=int(settings.min_free_disk))

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
        """Link the verified temp file into place; its directory is synced either way, so
        an upload of stored bytes takes what a new one takes (its time cannot tell a
        tenant that another stored them)."""
        final.parent.mkdir(exist_ok=True)
        try:
            os.link(tmp, final)
            created = True
        except FileExistsError:
            created = False
        _fsync_dir(final.parent)
        return created

    async def read(
        self, digest: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """The bytes [start, end) as read-only memoryviews of a memory map of the blob.

        Why a map: a GET then costs one copy per byte (page cache to socket, inside the
        kernel's send) instead of two (page cache into a new bytes object, then that into
        the socket), and a chunk waiting on a slow reader pins page-cache pages, not a
        private copy. Each chunk is faulted in by a worker thread before the event loop
        hands it to the socket, so the loop never waits for the disk.

        A map turns a file shrinking under it into SIGBUS. CAS files never do: they are
        written to a temp file and linked into place, removed only by unlink (which leaves
        a live map intact), never truncated or rewritten. Where the file system cannot map
        files, this falls back to positioned reads.
        """
        try:
            mapped = await to_thread.run_sync(_map_file, self.path_of(digest))
        except _Unmappable:
            async for chunk in self._read_copies(digest, start, end):
                yield chunk
            return
        if mapped is None:  # an empty blob
            return
        view = memoryview(mapped)
        end = len(view) if end is None else min(end, len(view))
        for offset in range(start, end, MAP_CHUNK):
            stop = min(end, offset + MAP_CHUNK)
            await to_thread.run_sync(_fault_in, mapped, offset, stop)
            # a bytes-like view: StreamingResponse, sockets and hashlib take any buffer
            yield view[offset:stop]  # type: ignore[misc]  # base.py types chunks as bytes

    async def _read_copies(
        self, digest: str, start: int, end: int | None
    ) -> AsyncIterator[bytes]:
        """Positioned reads in READ_CHUNK pieces: the open rides along with the first read
        and the close runs on the loop (a read-only descriptor closes without I/O)."""
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

    async def quarantine(self, digest: str, reason: str) -> bool:
        """Rename the file aside (same file system: atomic; a reader mid-stream keeps its
        map), with a note of why next to it. A later quarantine of the same digest (bytes
        uploaded again and rotted again) replaces the earlier copy."""
        def move() -> bool:
            self.quarantine_dir.mkdir(exist_ok=True)
            try:
                os.replace(self.path_of(digest), self.quarantine_dir / digest)
            except FileNotFoundError:
                return False
            (self.quarantine_dir / f"{digest}.reason").write_text(
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {reason}\n")
            _fsync_dir(self.path_of(digest).parent)
            return True

        try:
            return await to_thread.run_sync(move)
        except OSError as exc:
            raise _storage_error(exc) from exc

    async def delete_many(self, digests: list[str]) -> set[str]:
        """All the unlinks in one worker thread: one hop, not one per blob."""
        def unlink_all() -> set[str]:
            failed = set()
            for digest in digests:
                try:
                    os.unlink(self.path_of(digest))
                except FileNotFoundError:
                    pass
                except OSError:
                    failed.add(digest)
            return failed

        return await to_thread.run_sync(unlink_all)

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
        """Ready means able to store: a writable directory with disk above the reserve."""
        ok = await to_thread.run_sync(lambda: os.access(self.cas_dir, os.W_OK | os.X_OK))
        if not ok:
            raise ServiceUnavailable(f"blob directory {self.cas_dir} is not writable",
                                     code="store_unavailable")
        free = shutil.disk_usage(self.root).free
        if free < max(self.min_free_bytes, 1):
            raise ServiceUnavailable(
                f"disk full: {free} bytes free, reserve {self.min_free_bytes}", code="disk_full")


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


MAP_CHUNK = 4 * READ_CHUNK
"""Chunk of a mapped blob handed to the socket at once. A chunk is a view, not a copy, so a
larger one costs no memory; it saves thread hops and sends per byte."""

MADV_POPULATE_READ = 22
"""Linux >= 5.14: fault pages in, reading them from disk if needed (Python 3.11 lacks the
name). Older kernels refuse it; _fault_in then touches one byte per page."""


class _Unmappable(Exception):
    """The file system cannot map this file (some FUSE and network file systems)."""


def _map_file(path: Path) -> mmap.mmap | None:
    """A read-only map of the whole file (None if it is empty); the descriptor is closed
    at once, the map keeps the file alive until its last view is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size == 0:
            return None
        try:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise _Unmappable(str(exc)) from exc
    finally:
        os.close(fd)


def _fault_in(mapped: mmap.mmap, start: int, stop: int) -> None:
    """Make [start, stop) of the map resident, so sending it never waits for the disk."""
    first = start - start % mmap.PAGESIZE  # madvise wants a page-aligned start
    try:
        mapped.madvise(MADV_POPULATE_READ, first, stop - first)
    except OSError:
        view = memoryview(mapped)
        try:
            for page in range(first, stop, mmap.PAGESIZE):
                view[page]  # noqa: B018 - the read is the point
        finally:
            view.release()


def _storage_error(exc: OSError) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(f"blob store is full: {exc.strerror}", code="disk_full")
    return ServiceUnavailable(f"blob store I/O error: {exc}", code="store_unavailable")
