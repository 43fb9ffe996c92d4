"""Packing files into blobs and back: deterministic zstd tarballs, unpacked defensively.

The Mega-Cache bundle carries generated source, not compiled code; without the compiled
kernel `.so` files and the precompiled header a new machine still runs g++ for minutes.
Those files travel as packs. Packs are deterministic (sorted names, zeroed metadata), so
the same files give the same digest and the CAS stores them once.

Unpacking treats the blob as hostile: regular files only, relative names without `..`,
an allow-list of suffixes, a cap on decompressed bytes, and each file written to a temp
name then renamed, so a reader never sees half a kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tarfile
import uuid
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import IO

import zstandard

from megacache_client.errors import BadArtifact

ZSTD_LEVEL = 3
MAX_KERNEL_PACKS = 8
"""Kernel packs an entry may hold: its first (`kernels`) and the ones ranks that compiled
what it lacked added beside it (`kernels-2` ...); a process that rewrites the entry packs
them into one again."""


def pack_kind(role: str) -> str | None:
    """What a blob of `role` is as a pack: `kernels` (the first kernel pack, or one a rank
    added: `kernels-N`), `toolchain`, or None (not a pack: the bundle)."""
    if role in ("kernels", "toolchain"):
        return role
    head, _, n = role.partition("-")
    if head == "kernels" and n.isdigit() and 2 <= int(n) <= MAX_KERNEL_PACKS:
        return "kernels"
    return None


class PackError(ValueError, BadArtifact):
    """A pack or bundle is malformed, unsafe or over its size cap."""


def compress_bytes(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)


def decompress_bytes(data: bytes, raw_size: int, raw_sha256: str | None, cap: int) -> bytes:
    """Decompress a bundle, refusing anything over `cap` or not matching its raw digest."""
    if raw_size > cap:
        raise PackError(f"bundle would decompress to {raw_size} bytes, over the cap of {cap}")
    try:
        # python-zstandard sizes its output by the frame's declared content size and ignores
        # max_output_size when there is one: a frame that declares more is refused unread
        declared = zstandard.frame_content_size(data)
        if declared > raw_size:
            raise PackError(f"bundle's zstd frame declares {declared} bytes, manifest says "
                            f"{raw_size}")
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_size)
    except zstandard.ZstdError as exc:
        raise PackError(f"bundle is not valid zstd: {exc}") from None
    if len(raw) != raw_size:
        raise PackError(f"bundle decompressed to {len(raw)} bytes, manifest says {raw_size}")
    if raw_sha256 is not None and hashlib.sha256(raw).hexdigest() != raw_sha256:
        raise PackError("bundle's decompressed bytes do not match the manifest's raw_sha256")
    return raw


MAX_MEMBERS = 16_384
"""Files a pack may hold: a large model's kernels are a few thousand; past this a pack is
refused, not unpacked in full (empty members cost no bytes against the cap)."""
MAX_FOLDERS = 4_096
"""Distinct folders a pack's files may lie in: Inductor's caches fan out by a two-character
prefix (a few hundred folders); a 78 KB pack of empty files in as many folders once made
120,000 directories, each costing an inode and no bytes against the cap."""
MAX_NAME = 1_024
MAX_DEPTH = 32
"""A member's name: its length and how many folders deep it goes."""
MEMBER_COST = 512
"""What each member counts against the byte cap besides its size: its tar header."""

INDEX_NAME = "megacache-index.json"
"""A pack's optional first member: what each file is, independent of paths (relocate.py)."""
MAX_INDEX_BYTES = 64 * 1024 * 1024


def write_pack(files: Iterable[tuple[str, Path]], dest: Path, index: bytes | None = None
               ) -> tuple[int, int]:
    """Write (name, path) pairs as a deterministic zstd tar; returns (raw, stored) sizes.

    `index`, when given, is stored first under INDEX_NAME, so a reader finds it without
    decompressing the files behind it.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    raw_size = 0
    with open(dest, "wb") as out:
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
        with cctx.stream_writer(out, closefd=False) as zw, \
                tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            if index is not None:
                info = tarfile.TarInfo(INDEX_NAME)
                info.size, info.mode, info.mtime = len(index), 0o644, 0
                tar.addfile(info, io.BytesIO(index))
                raw_size += info.size
            for name, path in sorted(files):
                if name == INDEX_NAME:
                    raise PackError(f"{INDEX_NAME} is reserved for the pack index")
                info = tarfile.TarInfo(safe_name(name))
                info.size = path.stat().st_size
                info.mode = 0o755 if name.endswith(".so") else 0o644
                info.mtime = 0
                with open(path, "rb") as f:
                    tar.addfile(info, f)
                raw_size += info.size
    return raw_size, dest.stat().st_size


def pack_names(pack: Path, cap: int) -> list[str]:
    """The file names inside a pack (validated, the index left out), without extracting it."""
    return [m.name for m in _members(pack, cap, suffixes=None, into=None)]


def read_index(pack: Path) -> bytes | None:
    """The pack's index (its first member), or None for a pack made without one."""
    try:
        with open(pack, "rb") as raw, \
                zstandard.ZstdDecompressor().stream_reader(raw) as zr, \
                tarfile.open(fileobj=zr, mode="r|", bufsize=1 << 20) as tar:
            first = tar.next()
            if first is None or first.name != INDEX_NAME:
                return None
            if not first.isfile() or first.size > MAX_INDEX_BYTES:
                raise PackError(f"pack index is not a file of at most {MAX_INDEX_BYTES} bytes")
            src = tar.extractfile(first)
            assert src is not None
            return src.read()
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise PackError(f"pack is malformed: {exc}") from None


def unpack(pack: Path, into: Path, *, suffixes: tuple[str, ...], cap: int,
           present: set[str] | None = None) -> list[str]:
    """Extract a pack's allowed files into `into`, skipping files already present.

    Returns the names written; `present`, when given, gets the name of every file of the
    pack now in `into` (written or found). Raises PackError on an unsafe or oversized pack;
    files written before the error stay (each is complete and content-keyed by torch).
    """
    return [m.name for m in _members(pack, cap, suffixes=suffixes, into=into,
                                     present=present)]


def _members(pack: Path, cap: int, *, suffixes: tuple[str, ...] | None,
             into: Path | None, present: set[str] | None = None) -> list[tarfile.TarInfo]:
    seen: list[tarfile.TarInfo] = []
    total = folders = 0
    names: set[str] = set()
    try:
        with open(pack, "rb") as raw, \
                zstandard.ZstdDecompressor().stream_reader(raw) as zr, \
                tarfile.open(fileobj=zr, mode="r|", bufsize=1 << 20) as tar:
            for i, member in enumerate(tar):
                if i >= MAX_MEMBERS:
                    raise PackError(f"pack holds more than {MAX_MEMBERS} files")
                if not member.isfile():
                    raise PackError(f"pack entry {member.name!r} is not a regular file")
                name = safe_name(member.name)
                folders += _require_no_clash(name, names)
                if folders > MAX_FOLDERS:
                    raise PackError(f"pack's files lie in more than {MAX_FOLDERS} folders")
                total += member.size + MEMBER_COST
                if total > cap:
                    raise PackError(f"pack expands past the cap of {cap} bytes")
                if i == 0 and name == INDEX_NAME:
                    continue  # read by read_index, never extracted
                if suffixes is not None and not name.endswith(suffixes):
                    raise PackError(f"pack entry {name!r} has a suffix not allowed here")
                if into is not None:
                    target = into / name
                    if not target.exists():
                        src = tar.extractfile(member)
                        assert src is not None
                        try:
                            _write_atomic(target, src, member.size,
                                          executable=name.endswith(".so"))
                        except (NotADirectoryError, FileExistsError, IsADirectoryError):
                            raise PackError(f"pack entry {name!r} clashes with a file or "
                                            f"folder already in {into}") from None
                        seen.append(member)
                    if present is not None:
                        present.add(name)
                else:
                    seen.append(member)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise PackError(f"pack is malformed: {exc}") from None
    return seen


def _require_no_clash(name: str, names: set[str]) -> int:
    """Each member names a new file, never one already in the pack nor a folder of one
    (`a.so` then `a.so/b.so`): two members that clash are a malformed pack. Returns how
    many folders this member adds."""
    parents = {str(p) for p in PurePosixPath(name).parents if str(p) != "."}
    if name in names or f"{name}/" in names or parents & names:
        raise PackError(f"pack entry {name!r} clashes with an earlier entry")
    names.add(name)  # files by name, folders with a trailing slash
    new = {f"{p}/" for p in parents} - names
    names.update(new)
    return len(new)


def safe_name(name: str) -> str:
    """`name` if it is a relative path that stays inside the folder it is unpacked into."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in name \
            or any(p in ("", ".") for p in path.parts):
        raise PackError(f"unsafe file name in pack: {name!r}")
    if len(name) > MAX_NAME or len(path.parts) > MAX_DEPTH:
        raise PackError(f"pack entry name is over {MAX_NAME} characters or {MAX_DEPTH} "
                        f"folders deep: {name[:80]!r}")
    return str(path)


def _write_atomic(target: Path, src: IO[bytes], size: int,
                  executable: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.part")
    try:
        with open(tmp, "wb") as out:
            remaining = size
            while remaining > 0:
                chunk = src.read(min(remaining, 1 << 20))
                if not chunk:
                    raise PackError("pack ended in the middle of a file")
                out.write(chunk)
                remaining -= len(chunk)
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
