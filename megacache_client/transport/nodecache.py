"""Node-local blob cache: each blob is downloaded once per node, whatever the rank count.

The first local rank to want a blob takes a file lock and downloads it; the others wait on
the lock and then read the verified file from disk. A file is only ever renamed into place
after its digest checked out, and is checked again (size + sha256, cheap next to a
download) every time it is reused, so a corrupted disk copy is replaced, never loaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from megacache_client.errors import CorruptBlobError
from megacache_client.wire.manifest import sha256_file

_VERIFIED: dict[str, tuple[str, int, int, int]] = {}
"""path -> (digest, size, mtime_ns, inode) of each file this process hashed and found good:
what `was_verified` (the gate's digest check) compares with the file as it is now."""


class NodeCache:
    def __init__(self, root: Path, lock_timeout_s: float = 600.0) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.lock_dir = self.root / "locks"
        self.lock_timeout_s = lock_timeout_s

    def path(self, digest: str) -> Path:
        return self.blob_dir / digest

    def fetch(self, digest: str, size: int,
              download: Callable[[Path], str | None]) -> tuple[Path, int]:
        """The verified local path of a blob, and the bytes this call downloaded (0 if cached).

        `download(tmp_path)` must write the blob to `tmp_path` (and may raise); it returns
        the sha256 it computed of what it wrote while writing (one pass over a multi-GB
        bundle), or None to have it hashed here.
        """
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        final = self.path(digest)
        try:
            with FileLock(str(self.lock_dir / f"{digest}.lock"), timeout=self.lock_timeout_s):
                if self.verified(final, digest, size):
                    return final, 0
                tmp = final.with_name(f".{digest}.{os.getpid()}.part")
                try:
                    hashed = download(tmp)
                    os.replace(tmp, final)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        tmp.unlink()
                self._adopt_download(final, digest, size, hashed)
                return final, size
        except Timeout:
            raise TimeoutError(
                f"waited {self.lock_timeout_s:.0f}s for another rank to download {digest[:12]}…"
            ) from None

    def _adopt_download(self, path: Path, digest: str, size: int, hashed: str | None) -> None:
        """Record a fresh download as verified, or refuse it (deleted)."""
        if hashed is None:
            if not self.verified(path, digest, size):
                raise CorruptBlobError(f"blob {digest[:12]}… does not hash to its address")
            return
        stat = path.stat()
        if hashed != digest or stat.st_size != size:
            path.unlink(missing_ok=True)
            raise CorruptBlobError(f"blob {digest[:12]}… does not hash to its address")
        _VERIFIED[str(path)] = (digest, size, stat.st_mtime_ns, stat.st_ino)

    def add(self, digest: str, source: Path) -> Path:
        """Adopt a file this process produced (a pack it will upload) as a cached blob."""
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        final = self.path(digest)
        os.replace(source, final)
        return final

    @staticmethod
    def verified(path: Path, digest: str, size: int) -> bool:
        """Whether `path` holds the blob (size and sha256); a wrong file is removed."""
        try:
            stat = path.stat()
            if stat.st_size != size:
                path.unlink()
                return False
        except FileNotFoundError:
            return False
        if sha256_file(path) != digest:
            path.unlink(missing_ok=True)
            return False
        _VERIFIED[str(path)] = (digest, size, stat.st_mtime_ns, stat.st_ino)
        return True

    @staticmethod
    def was_verified(path: Path, digest: str, size: int) -> bool:
        """Whether this process hashed `path` and found it to be the blob, and the file has
        not changed since (checked by its size, modification time and inode, not re-hashed:
        a multi-GB bundle would be hashed twice)."""
        try:
            stat = path.stat()
        except OSError:
            return False
        return _VERIFIED.get(str(path)) == (digest, size, stat.st_mtime_ns, stat.st_ino) \
            and stat.st_size == size
