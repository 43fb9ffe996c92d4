"""Placing packs (megacache_client/steps/load.py): once per node, however many local ranks ask."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from filelock import FileLock

from megacache_client.steps.load import _unpack_once
from megacache_client.torch.packs import PackError, unpack, write_pack


def _pack(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.so").write_bytes(os.urandom(3000))
    (src / "b.so").write_bytes(os.urandom(2000))
    pack = tmp_path / "blobs" / ("ab" * 32)  # the node cache names a blob by its digest
    pack.parent.mkdir()
    write_pack([("sub/a.so", src / "sub" / "a.so"), ("b.so", src / "b.so")], pack)
    return pack


def test_a_pack_placed_once_is_not_unpacked_again_until_its_files_go(tmp_path: Path):
    pack, root = _pack(tmp_path), tmp_path / "root"
    assert _unpack_once(pack, root, (".so",), cap=10**6) == 2
    assert (root / "sub" / "a.so").is_file() and (root / "b.so").is_file()
    good = pack.read_bytes()
    pack.write_bytes(b"not a pack")  # a second placing that read it would fail
    assert _unpack_once(pack, root, (".so",), cap=10**6) == 2
    (root / "b.so").unlink()  # a TMPDIR cleaner: the next placing unpacks again
    try:
        _unpack_once(pack, root, (".so",), cap=10**6)
        raise AssertionError("a placing whose files are gone must unpack the pack again")
    except PackError:
        pass
    pack.write_bytes(good)
    assert _unpack_once(pack, root, (".so",), cap=10**6) == 2
    assert (root / "b.so").is_file()


def test_a_mangled_list_of_placed_files_means_placing_again(tmp_path: Path):
    pack, root = _pack(tmp_path), tmp_path / "root"
    _unpack_once(pack, root, (".so",), cap=10**6)
    mark = root / f".megacache-placed-{pack.name}"
    for text in ('["../../etc/passwd"]', "{", '{"b.so": 1}', "[1]"):
        mark.write_text(text)
        assert _unpack_once(pack, root, (".so",), cap=10**6) == 2
        assert mark.read_text() == '["b.so", "sub/a.so"]'


def test_a_rank_waits_for_the_rank_placing_the_same_pack(tmp_path: Path):
    """While another rank of the node holds the pack's lock, a rank neither reads the pack
    nor places a file; once that rank has placed it, the waiting rank takes its files."""
    pack, root = _pack(tmp_path), tmp_path / "root"
    good = pack.read_bytes()
    root.mkdir()
    lock = root / f".megacache-placing-{pack.name}.lock"
    holder = FileLock(str(lock))
    holder.acquire()  # another rank of this node is placing it
    pack.write_bytes(b"not a pack")  # a rank that did not wait would read it and fail
    outcome: list[int | Exception] = []

    def place() -> None:
        try:
            outcome.append(_unpack_once(pack, root, (".so",), cap=10**6))
        except Exception as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=place)
    waiter.start()
    waiter.join(timeout=1.0)  # time enough to have failed on the pack, had it not waited
    assert outcome == [] and [p.name for p in root.iterdir()] == [lock.name]

    # the other rank places the pack (and lists its files), then lets go
    pack.write_bytes(good)
    present: set[str] = set()
    unpack(pack, root, suffixes=(".so",), cap=10**6, present=present)
    (root / f".megacache-placed-{pack.name}").write_text(json.dumps(sorted(present)))
    placed = {n: (root / n).stat().st_ino for n in present}
    pack.write_bytes(b"not a pack")  # the waiter must take those files, not unpack again
    holder.release()
    waiter.join(timeout=30)
    assert outcome == [2], outcome
    assert {n: (root / n).stat().st_ino for n in present} == placed
    assert (root / "b.so").read_bytes() == (tmp_path / "src" / "b.so").read_bytes()
