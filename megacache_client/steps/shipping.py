"""The blobs a publish ships and the entries that name them.

A bundle, a kernels pack and a toolchain pack are written to the node cache first (the
upload streams from disk, and a later run on this node finds them there), uploaded when the
server lacks them, then named by one entry per fingerprint. `bundle_blob`, `build_manifest`
and `upload_blobs` also serve `megacache push`, which ships a bundle made elsewhere without
a session.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from megacache_client.config import ClientConfig
from megacache_client.results import Snapshot, Track
from megacache_client.steps.load import TOOLCHAIN_SUFFIXES
from megacache_client.torch import env as torch_env
from megacache_client.torch import relocate
from megacache_client.torch.packs import (
    PackError,
    compress_bytes,
    pack_kind,
    pack_names,
    read_index,
    write_pack,
)
from megacache_client.transport.client import ByteProgress, RemoteCache
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest, sha256_file, sha256_hex
from megacache_client.wire.text import as_text
from megacache_client.wire.version import __version__

log = logging.getLogger("megacache")


def upload_and_write(remote: RemoteCache, snap: Snapshot, config: ClientConfig,
                      node: NodeCache, first: Track) -> list[Track]:
    """Upload the snapshot's blobs, then write each track's entry; the tracks whose entry
    another writer changed meanwhile (the conditional PUT lost)."""
    blobs = [bundle_blob(node, snap.raw, snap.meta)]
    if config.ship_kernels and snap.kernels:
        blobs.append(pack_blob(node, "kernels", snap.kernels,
                                relocate.recorder().ids_for(snap.kernels)))
    if config.ship_toolchain:
        toolchain = toolchain_blob(remote, node, first)
        if toolchain is not None:
            blobs.append(toolchain)
    snap.tracks[0].publish.bytes_up += upload_blobs(remote, node, blobs)
    return [track for track in snap.tracks if not _put_entry(remote, track, blobs, snap)]


def _put_entry(remote: RemoteCache, track: Track, blobs: list[BlobRef], snap: Snapshot
               ) -> bool:
    """Write the track's entry; False when another writer's version stands in the way."""
    res, load = track.publish, track.load
    manifest = build_manifest(track.fp, blobs, snap.counts, snap.compile_s, load.entry)
    # a later round replaces the version this process wrote; a republish, the version it
    # loaded; a trusted writer, the one it refused
    replaced = res.etag or (load.etag if load.outcome == "hit" and load.etag
                            else load.untrusted_etag)
    etag = remote.put_entry(manifest, if_match=replaced or None,
                            if_none_match=None if replaced else "*")
    res.key = manifest.key
    if etag is None:
        res.reason = ("another producer changed this entry since this process wrote it"
                      if res.etag else "another producer published this key first")
        return False
    res.published, res.etag, res.rounds = True, etag, res.rounds + 1
    res.reason = f"published {len(blobs)} blob(s)" + (
        f" (round {res.rounds})" if res.rounds > 1 else "")
    log.info("megacache: published %s for %s (%d bytes uploaded)", manifest.key[:12],
             track.fp.model, res.bytes_up)
    return True



def bundle_blob(node: NodeCache, raw: bytes, meta: dict[str, str] | None = None) -> BlobRef:
    """The Mega-Cache bundle `raw` compressed into the node cache, as the blob to upload."""
    data = compress_bytes(raw)
    digest = sha256_hex(data)
    tmp = node.blob_dir / f".{uuid.uuid4().hex}.new"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    node.add(digest, tmp)
    return BlobRef(digest=digest, size=len(data), role="megacache", compression="zstd",
                   raw_size=len(raw), raw_sha256=sha256_hex(raw), meta=meta or {})


def pack_blob(node: NodeCache, role: str, files: dict[str, Path], ids: dict[str, str],
               contents: str | None = None) -> BlobRef:
    """A pack of compiled files with its identity index; its meta says what build made
    it (the consumer's check), never where torch was installed."""
    tmp = node.blob_dir / f".{uuid.uuid4().hex}.new"
    raw_size, size = write_pack(files.items(), tmp, index=relocate.index_bytes(ids))
    digest = sha256_file(tmp)
    node.add(digest, tmp)
    meta = {**relocate.build_meta(), "files": str(len(files))}
    if contents is not None:
        meta["contents"] = contents
    return BlobRef(digest=digest, size=size, role=role, compression="zstd",
                   raw_size=raw_size, meta=meta)


def toolchain_blob(remote: RemoteCache, node: NodeCache, first: Track) -> BlobRef | None:
    """The precompiled header pack, reusing one already stored when it holds our files.

    The header is model-independent but g++ does not write it byte-identically twice, so
    content addressing alone would store a new ~21 MB copy per cold producer. Its
    path-free content (identities of header text + flags) is recorded in the blob's
    meta: a stored pack with the same contents and build facts is the same toolchain,
    wherever its producer's torch was installed.
    """
    files = find_files(torch_env.header_dir(), TOOLCHAIN_SUFFIXES, exclude=("locks",))
    if not files:
        return None
    ids = relocate.recorder().ids_for(files)
    files = relocate.dedupe(files, ids)
    contents = sha256_hex(",".join(sorted(relocate.content_ids(files, ids))).encode())
    for entry in _toolchain_sources(remote, first):
        blob = entry.blob("toolchain")
        if blob is not None and blob.meta.get("contents") == contents \
                and not relocate.refusal(blob.meta):
            return blob
    return pack_blob(node, "toolchain", files, ids, contents=contents)


def _toolchain_sources(remote: RemoteCache, first: Track) -> Iterator[Manifest]:
    """Entries whose toolchain pack this publish may name instead of its own: the one it
    loaded, then entries of its env and hw the listing nominates, each read by key through
    the gate (an entry names only packs its consumers would admit: never one of a writer
    they do not trust, which the unsigned listing may name)."""
    if first.load.entry is not None:
        yield first.load.entry
    try:
        listed = remote.list_entries(env=first.fp.env, hw=first.fp.hw, limit=20)
    except Exception:
        return
    for nominee in [m for m in listed if m.blob("toolchain") is not None][:3]:
        try:
            served = remote.get_entry(nominee.key)
        except Exception:
            continue
        if served is not None:
            yield served.manifest


def build_manifest(fp: Fingerprint, blobs: list[BlobRef], counts: dict[str, int],
                   compile_s: float, loaded: Manifest | None = None) -> Manifest:
    """cold_compile_s stays the cold time: a partly warm run only raises it, never lowers."""
    cold = compile_s if loaded is None else max(compile_s, loaded.cold_compile_s)
    return Manifest(
        key=fp.key(), blobs=blobs, fingerprint=fp,
        torch_version=torch_env.torch_version(), triton_version=torch_env.triton_version(),
        artifact_counts=counts, cold_compile_s=round(cold, 3),
        created_at=datetime.now(timezone.utc),
        # RANK is the launcher's text, not ours: escaped to the text rule (wire/text.py)
        producer={"client": f"megacache {__version__}",
                  "rank": as_text(os.environ.get("RANK", "0"), 256)},
    )


def upload_blobs(remote: RemoteCache, node: NodeCache, blobs: list[BlobRef],
                 progress: ByteProgress | None = None) -> int:
    """Upload the blobs the server lacks (HEAD before PUT); returns the bytes sent."""
    sent = 0
    for blob in blobs:
        if not remote.has_blob(blob.digest):
            remote.upload_blob(node.path(blob.digest), blob.digest, progress)
            sent += blob.size
    return sent


def find_files(root: Path, suffixes: tuple[str, ...], exclude: tuple[str, ...]) -> dict[str, Path]:
    if not root.is_dir():
        return {}
    found = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if rel.parts[0] in exclude or not path.is_file() or path.name.startswith("."):
            continue
        if path.name.endswith(suffixes):
            found[rel.as_posix()] = path
    return found


def entry_kernel_ids(entry: Manifest, node: NodeCache, cap: int) -> set[str]:
    """What the entry's kernel packs hold (relocate.content_ids), read from the node cache
    (a pack not there counts as empty)."""
    ids: set[str] = set()
    for blob in entry.blobs:
        if pack_kind(blob.role) != "kernels":
            continue
        path = node.path(blob.digest)
        if not NodeCache.verified(path, blob.digest, blob.size):
            continue
        try:
            names = pack_names(path, cap)
            ids |= relocate.content_ids(names, relocate.parse_index(read_index(path)))
        except PackError:
            continue
    return ids
