"""Kernel packs and bundles (megacache_client/torch/packs.py): deterministic, safe to unpack,
capped."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
import zstandard
from helpers import sha256

from megacache_client.torch.packs import (
    PackError,
    compress_bytes,
    decompress_bytes,
    pack_names,
    unpack,
    write_pack,
)


def test_pack_round_trip_is_deterministic(tmp_path: Path):
    src = tmp_path / "src"
    (src / "ab").mkdir(parents=True)
    (src / "ab" / "k1.so").write_bytes(os.urandom(5000))
    (src / "cd.so").write_bytes(b"x" * 10000)
    files = {"ab/k1.so": src / "ab" / "k1.so", "cd.so": src / "cd.so"}
    raw1, _ = write_pack(files.items(), tmp_path / "p1")
    os.utime(src / "cd.so", (1, 1))
    write_pack(reversed(list(files.items())), tmp_path / "p2")
    assert raw1 == 15000
    assert (tmp_path / "p1").read_bytes() == (tmp_path / "p2").read_bytes()
    assert pack_names(tmp_path / "p1", cap=10**6) == ["ab/k1.so", "cd.so"]
    out = tmp_path / "out"
    assert unpack(tmp_path / "p1", out, suffixes=(".so",), cap=10**6) == ["ab/k1.so", "cd.so"]
    assert (out / "ab" / "k1.so").read_bytes() == files["ab/k1.so"].read_bytes()
    assert os.access(out / "cd.so", os.X_OK)
    # already-present files are left alone
    assert unpack(tmp_path / "p1", out, suffixes=(".so",), cap=10**6) == []


def _evil_pack(path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


@pytest.mark.parametrize("name, kind", [
    ("../escape.so", tarfile.REGTYPE),
    ("/abs/escape.so", tarfile.REGTYPE),
    ("a/../../escape.so", tarfile.REGTYPE),
    ("link.so", tarfile.SYMTYPE),
    ("evil.py", tarfile.REGTYPE),
])
def test_unsafe_packs_are_refused(tmp_path: Path, name: str, kind: bytes):
    member = tarfile.TarInfo(name)
    member.type = kind
    member.size = 4 if kind == tarfile.REGTYPE else 0
    if kind == tarfile.SYMTYPE:
        member.linkname = "/etc/passwd"
    pack = _evil_pack(tmp_path / "evil", member, b"boom" if kind == tarfile.REGTYPE else b"")
    out = tmp_path / "out"
    with pytest.raises(PackError):
        unpack(pack, out, suffixes=(".so",), cap=10**6)
    assert not (tmp_path / "escape.so").exists()
    assert not any(out.rglob("*")) if out.exists() else True


def test_pack_and_bundle_caps(tmp_path: Path):
    (tmp_path / "big.so").write_bytes(b"\0" * 100_000)
    write_pack([("big.so", tmp_path / "big.so")], tmp_path / "p")
    with pytest.raises(PackError, match="cap"):
        unpack(tmp_path / "p", tmp_path / "out", suffixes=(".so",), cap=50_000)
    raw = b"\0" * 1_000_000
    data = compress_bytes(raw)
    assert decompress_bytes(data, len(raw), sha256(raw), cap=10**7) == raw
    with pytest.raises(PackError, match="cap"):
        decompress_bytes(data, len(raw), None, cap=1000)
    with pytest.raises(PackError):  # manifest lies about the raw size: torch never sees it
        decompress_bytes(data, 10, None, cap=10**7)
    with pytest.raises(PackError, match="raw_sha256"):
        decompress_bytes(data, len(raw), sha256(b"other"), cap=10**7)
    with pytest.raises(PackError, match="zstd"):
        decompress_bytes(b"not zstd at all", 10, None, cap=10**7)
    with pytest.raises(PackError, match="malformed"):
        pack_names(_write(tmp_path / "junk", b"junk"), cap=10**6)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
