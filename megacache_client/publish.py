"""The publish side of a session: snapshot this run's artifacts, pack them, upload, write.

What a run ships is what torch saved, plus what it loaded from exact hits (a graph served
from the cache is not saved again), plus its compiled kernels and the toolchain headers, as
content-addressed blobs; each fingerprint the process compiled under then gets its own
entry naming them. Blobs are written to the node cache first, so the upload streams from
disk and a later run on this node finds them there. Every function raises on trouble: the
session decides what a failure costs.

`bundle_blob` and `upload_blobs` also serve `megacache push`, which ships a bundle made
elsewhere without a session.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from megacache_client import precompile, relocate, torch_env
from megacache_client._version import __version__
from megacache_client.config import ClientConfig
from megacache_client.load import KERNEL_SUFFIXES, TOOLCHAIN_SUFFIXES, read_bundle
from megacache_client.manifest import BlobRef, Fingerprint, Manifest, sha256_file, sha256_hex
from megacache_client.nodecache import NodeCache
from megacache_client.packs import PackError, compress_bytes, pack_names, read_index, write_pack
from megacache_client.results import Snapshot, Track
from megacache_client.transport import Progress, RemoteCache, TransportError, UntrustedWriterError

log = logging.getLogger("megacache")


# -- snapshot: what this run has that its entries lack ------------------------------------
def save_for_shipping(precompile_keys: dict[str, list[str]]
                      ) -> tuple[torch_env.Artifacts, str] | None:
    """torch's Mega-Cache of this process as artifacts to ship, and why its precompiled
    Dynamo output is not among them ("" when it is); None when torch recorded nothing."""
    saved = torch_env.save_bundle()
    if saved is None:
        return None
    artifacts = torch_env.read_artifacts(saved[0])
    if artifacts is None:
        raise ValueError("torch could not read its own Mega-Cache bytes")
    return precompile.for_shipping(artifacts, precompile_keys)


def snapshot(artifacts: torch_env.Artifacts, tracks: Sequence[Track], node: NodeCache,
             cap: int) -> Snapshot | None:
    """This run's artifacts and kernels, listed on the caller's thread (fast), with the
    tracks whose entries lack some of them; None when no entry lacks anything.

    Kernels compare by path-free identity: a consumer whose torch is elsewhere holds the
    entry's kernels under other names, and must not publish them back as new (thrash).
    """
    keys = torch_env.keys_of(artifacts)
    kernels = _files(torch_env.inductor_cache_dir(), KERNEL_SUFFIXES,
                     exclude=("triton", "locks"))
    ids = relocate.recorder().ids_for(kernels)
    kernels = relocate.dedupe(kernels, ids)
    new_keys = {(kind, k) for kind, ks in keys.items() for k in ks}
    lacking = [t for t in tracks
               if _lacks(t, tracks, new_keys, relocate.content_ids(kernels, ids), node, cap)]
    if not lacking:
        return None
    artifacts = torch_env.merged(_loaded_artifacts(tracks, node, cap), artifacts)
    counts = {kind: len(ks) for kind, ks in torch_env.keys_of(artifacts).items()}
    return Snapshot(torch_env.to_bytes(artifacts), counts, kernels,
                    torch_env.compile_seconds(), lacking)


def _loaded_artifacts(tracks: Sequence[Track], node: NodeCache, cap: int
                      ) -> torch_env.Artifacts:
    """What this process loaded from exact hits, read again from the node cache.

    torch's save holds only what this process recorded, and a graph served by a
    precompiled Dynamo entry is never looked up in the FX-graph or AOTAutograd caches, so
    a republish built from the save alone would drop every graph the run loaded but did
    not compile. Fallback entries are left out: they are another code version's.
    """
    out: torch_env.Artifacts = {}
    seen: set[str] = set()
    for track in tracks:
        load = track.load
        ref = load.entry.blob("megacache") if load.entry is not None else None
        if load.outcome != "hit" or ref is None or ref.digest in seen:
            continue
        seen.add(ref.digest)
        path = node.path(ref.digest)
        if not NodeCache.verified(path, ref.digest, ref.size):
            continue
        artifacts = torch_env.read_artifacts(read_bundle(ref, path, cap)) or {}
        loaded = _loaded_with(tracks, ref)
        out = torch_env.merged(out, {
            kind: [a for a in items if (kind, a.key) in loaded]
            for kind, items in artifacts.items()})
    return out


def _lacks(track: Track, tracks: Sequence[Track], new_keys: set[tuple[str, str]],
           kernel_ids: set[str], node: NodeCache, cap: int) -> bool:
    """Whether this track's entry should be (re)written with this run's artifacts."""
    load, res = track.load, track.publish
    # bad bytes the server confirmed and took out of service: this run's clean bundle is
    # what replaces them; after any other failed load, publishing is not to be trusted
    healed = load.outcome == "invalid" and load.reported in ("quarantined", "withdrawn")
    if load.outcome in ("invalid", "error") and not healed:
        res.reason = f"not publishing after a failed load ({load.outcome})"
        return False
    if load.outcome == "hit" and load.entry is not None \
            and new_keys <= _loaded_with(tracks, load.entry.blob("megacache")) \
            and kernel_ids <= _entry_pack_ids(load.entry, "kernels", node, cap):
        res.reason = "the loaded entry already has everything this run compiled"
        return False
    return True


def _loaded_with(tracks: Sequence[Track], bundle: BlobRef | None) -> set[tuple[str, str]]:
    """What every track that loaded this bundle got from it: torch keeps one
    Mega-Cache per process, so the tracks of one process share what they loaded."""
    keys: set[tuple[str, str]] = set()
    for t in tracks:
        other = t.load.entry.blob("megacache") if t.load.entry is not None else None
        if other is not None and bundle is not None and other.digest == bundle.digest:
            keys |= t.load.loaded_keys
    return keys


def _entry_pack_ids(entry: Manifest, role: str, node: NodeCache, cap: int) -> set[str]:
    """What the entry's pack holds (relocate.content_ids), read from the node cache."""
    blob = entry.blob(role)
    if blob is None:
        return set()
    path = node.path(blob.digest)
    if not NodeCache.verified(path, blob.digest, blob.size):
        return set()
    try:
        names = pack_names(path, cap)
        return relocate.content_ids(names, relocate.parse_index(read_index(path)))
    except PackError:
        return set()


# -- upload: the blobs once, then an entry per track --------------------------------------
def upload(snap: Snapshot, config: ClientConfig, node: NodeCache, first: Track,
           holder: str = "") -> None:
    """Upload the blobs once, then write each track's entry (its own key, its own etag).
    `first` is the session's first track: its entry and fingerprint find a stored
    toolchain pack to reuse.

    A first publish of a key is claimed first (`holder` names this process): when a cold
    fleet starts, every node compiles and would upload the same ~20 MB-to-GBs only to lose
    the conditional PUT; the claimant uploads, the others skip. A skipped track then waits
    (within `publish_wait_s`) for the claimant's entry and adds what this run compiled that
    it lacks, or takes the key over if the claim lapses with no entry written (the
    claimant died). A republish (adding to an entry this run loaded) needs no claim: its
    conditional PUT orders it.
    """
    deadline = time.monotonic() + config.publish_wait_s
    with RemoteCache(config) as remote:
        _keep_off_untrusted(remote, snap, config)
        claimed, skipped = _claim_first_publishes(remote, snap, holder, config.claim_lease_s) \
            if holder else ([], [])
        try:
            if snap.tracks:
                _upload_and_write(remote, snap, config, node, first)
        finally:
            _release(remote, claimed, holder)
        for track, other in skipped:
            _follow(_Follow(remote, snap, config, node, first, holder, deadline), track, other)


def _release(remote: RemoteCache, keys: list[str], holder: str) -> None:
    """Give up our claims once written (or given up): the next publisher need not wait
    for the lease to run out."""
    for key in keys:
        try:
            remote.release_claim(key, holder=holder)
        except Exception as exc:  # the lease runs out on its own
            log.debug("megacache: releasing the claim on %s failed: %s", key[:12], exc)


def _keep_off_untrusted(remote: RemoteCache, snap: Snapshot, config: ClientConfig) -> None:
    """A track whose key holds an entry this consumer refused for its writer publishes over
    it only if this process is itself a trusted writer: else any token could replace a
    poisoned entry with another of its own, or a trusted one with anything."""
    refused = [t for t in snap.tracks if t.load.untrusted_etag]
    policy = config.writer_policy
    if not refused or policy is None:
        return
    try:
        trusted = policy.trusts(*remote.whoami())
    except Exception as exc:
        log.debug("megacache: whoami failed (%s): not publishing over untrusted entries", exc)
        trusted = False
    if trusted:
        return
    for track in refused:
        track.publish.key = track.fp.key()
        track.publish.reason = ("the entry at this key is from an untrusted writer and this "
                                "process is not a trusted writer: not publishing over it")
    snap.tracks[:] = [t for t in snap.tracks if t not in refused]


def _claim_first_publishes(remote: RemoteCache, snap: Snapshot, holder: str, lease_s: float
                           ) -> tuple[list[str], list[tuple[Track, str]]]:
    """Claim the key of each track that publishes for the first time; a track whose key
    another process holds (or wrote meanwhile) is dropped from `snap.tracks`, with the
    reason. Returns the keys claimed (to release once written) and the dropped tracks with
    who holds their key ("" when written meanwhile), to follow once ours are written. A
    claim that fails publishes as if unclaimed: the conditional PUT still keeps one entry."""
    claimed: list[str] = []
    kept: list[Track] = []
    skipped: list[tuple[Track, str]] = []
    for track in snap.tracks:
        if track.load.outcome == "hit" and track.load.etag:
            kept.append(track)  # a republish of the entry this run loaded
            continue
        key = track.fp.key()
        try:
            other = remote.claim(key, holder=holder, lease_s=lease_s)
        except TransportError as exc:
            log.debug("megacache: claiming %s failed (%s): publishing unclaimed", key[:12], exc)
            kept.append(track)
            continue
        if other is None:
            claimed.append(key)
            if track.load.untrusted_etag or _vacant(remote, key):
                kept.append(track)
                continue
            other = ""  # the claimant before us wrote it and let go
        track.publish.key = key
        track.publish.reason = (f"{_skip_note(other)}; a later run that loads the entry adds "
                                "what it lacks")
        skipped.append((track, other))
    snap.tracks[:] = kept
    return claimed, skipped


def _skip_note(other: str) -> str:
    """Why a track did not upload: who holds its key, or that it was written meanwhile."""
    if not other:
        return "another publisher wrote this key meanwhile: upload skipped"
    return f"another publisher ({other}) is publishing this key: upload skipped"


def _vacant(remote: RemoteCache, key: str) -> bool:
    """No entry at `key` (one refused for its writer counts as taken: it was written
    meanwhile, and only the writer policy's own publish replaces it)."""
    try:
        return remote.get_entry(key) is None
    except UntrustedWriterError:
        return False


def _upload_and_write(remote: RemoteCache, snap: Snapshot, config: ClientConfig,
                      node: NodeCache, first: Track) -> None:
    blobs = [bundle_blob(node, snap.raw, precompile.producer_meta(snap.counts))]
    if config.ship_kernels and snap.kernels:
        blobs.append(_pack_blob(node, "kernels", snap.kernels,
                                relocate.recorder().ids_for(snap.kernels)))
    if config.ship_toolchain:
        toolchain = _toolchain_blob(remote, node, first)
        if toolchain is not None:
            blobs.append(toolchain)
    snap.tracks[0].publish.bytes_up += upload_blobs(remote, node, blobs)
    for track in snap.tracks:
        _put_entry(remote, track, blobs, snap)


def _put_entry(remote: RemoteCache, track: Track, blobs: list[BlobRef], snap: Snapshot
               ) -> None:
    res, load = track.publish, track.load
    manifest = build_manifest(track.fp, blobs, snap.counts, snap.compile_s, load.entry)
    # a republish replaces the version it loaded; a trusted writer, the one it refused
    replaced = load.etag if load.outcome == "hit" and load.etag else load.untrusted_etag
    etag = remote.put_entry(manifest, if_match=replaced or None,
                            if_none_match=None if replaced else "*")
    res.key = manifest.key
    if etag is None:
        res.reason = "another producer published this key first"
    else:
        res.published, res.reason = True, f"published {len(blobs)} blob(s)"
        log.info("megacache: published %s for %s (%d bytes uploaded)", manifest.key[:12],
                 track.fp.model, res.bytes_up)


# -- follow: a skipped track adds what the claimant's entry lacks ------------------------
FOLLOW_POLL_S = (0.5, 8.0)
"""A skipped publisher looks for the claimant's entry (a GET, then a claim POST while there
is none) after 0.5 s, then ever less often, up to every 8 s, each wait jittered: a cold
fleet of 1,000 nodes asking every 0.5 s would be 4,000 requests a second to the server for
as long as the claimant uploads."""


def _follow_waits() -> Iterator[float]:
    """Seconds to wait before each look: doubling from FOLLOW_POLL_S[0] to [1], +-25 %."""
    wait = FOLLOW_POLL_S[0]
    while True:
        yield wait * random.uniform(0.75, 1.25)
        wait = min(wait * 2, FOLLOW_POLL_S[1])


@dataclass
class _Follow:
    """What following a claimant needs: this publish's parts and when to give up."""

    remote: RemoteCache
    snap: Snapshot
    config: ClientConfig
    node: NodeCache
    first: Track
    holder: str
    deadline: float


def _follow(f: _Follow, track: Track, other: str) -> None:
    """Wait for the claimant's entry (until `f.deadline`), then add what it lacks.

    Without this, a node whose run compiled graphs the claimant's did not would drop them
    until some later run loads the entry and republishes. Never raises: the track's reason
    says how it ended (its skip reason stays when it gave up).
    """
    waits = _follow_waits()
    try:
        while not _follow_step(f, track, other):
            wait = next(waits)
            if time.monotonic() + wait > f.deadline:
                track.publish.reason = (
                    f"{_skip_note(other)}; its entry did not appear within publish_wait_s "
                    f"({f.config.publish_wait_s:g}s); a later run that loads the entry adds "
                    "what it lacks")
                return
            time.sleep(wait)
    except UntrustedWriterError:
        track.publish.reason = (f"{_skip_note(other)}; the entry written is from an "
                                "untrusted writer: not adding to it")
    except Exception as exc:
        track.publish.reason = (f"{_skip_note(other)}; then publishing what the entry "
                                f"lacks failed: {type(exc).__name__}: {exc}")[:500]
        log.warning("megacache: %s", track.publish.reason)


def _follow_step(f: _Follow, track: Track, other: str) -> bool:
    """One look: add to the entry if it is there; take the key over if the claim is free
    and there is still no entry (the claimant died or gave up). False: look again later
    (the claim is still held, or another writer changed the entry while we merged)."""
    key = track.fp.key()
    got = f.remote.get_entry(key)
    if got is not None:
        return _add_lacking(f, track, other, *got)
    if f.remote.claim(key, holder=f.holder, lease_s=f.config.claim_lease_s) is not None:
        return False
    try:
        if not _vacant(f.remote, key):
            return False  # written just now: the next look adds to it
        one = Snapshot(f.snap.raw, f.snap.counts, f.snap.kernels, f.snap.compile_s, [track])
        _upload_and_write(f.remote, one, f.config, f.node, f.first)
    finally:
        _release(f.remote, [key], f.holder)
    if not track.publish.published:
        return False  # another producer wrote first: add to theirs
    whose = f"the claim of {other}" if other else "the claim"
    track.publish.reason = (f"{whose} lapsed with no entry written: took the key over and "
                            f"{track.publish.reason}")
    return True


def _add_lacking(f: _Follow, track: Track, other: str, entry: Manifest, etag: str) -> bool:
    """Write over the entry read (If-Match) a merged bundle: its artifacts and those of
    ours it lacks, its other blobs kept; upload only our new blobs. True when done
    (written, or nothing to add); False when another writer changed it meanwhile."""
    res = track.publish
    res.key = entry.key
    ref = entry.blob("megacache")
    if ref is None:
        raise PackError("the claimant's entry has no megacache bundle")
    same = ref.raw_sha256 is not None and ref.raw_sha256 == sha256_hex(f.snap.raw)
    theirs = {} if same else _bundle_artifacts(f, ref)
    new = {} if same else _lacking(theirs, _artifacts_of(f.snap.raw))
    kernels = f.config.ship_kernels and bool(f.snap.kernels) and entry.blob("kernels") is None
    if not any(new.values()) and not kernels:
        res.reason = (f"{_skip_note(other)}; the claimant's entry already has everything "
                      "this run compiled")
        return True
    extra = _extra_blobs(f, entry, kernels)
    artifacts = torch_env.merged(theirs, new) if any(new.values()) else None
    counts = {kind: len(ks) for kind, ks in torch_env.keys_of(artifacts).items()} \
        if artifacts is not None else dict(entry.artifact_counts)
    bundle = _merged_bundle(f.node, ref, theirs, artifacts, counts) \
        if artifacts is not None else ref
    blobs = [bundle, *(b for b in entry.blobs if b.role != "megacache"), *extra]
    ours = [b for b in (bundle, *extra) if b is not ref]
    sent = upload_blobs(f.remote, f.node, ours)
    res.bytes_up += sent
    manifest = build_manifest(track.fp, blobs, counts, f.snap.compile_s, entry)
    if f.remote.put_entry(manifest, if_match=etag) is None:
        return False
    added = sum(len(items) for items in new.values())
    what = [f"{added} artifact(s)"] if added else []
    what += [f"its {b.role} pack" for b in extra]
    res.published = True
    res.reason = (f"{_skip_note(other)}; added to the claimant's entry what this run compiled "
                  f"and it lacked: {' and '.join(what)} ({sent} bytes uploaded)")
    log.info("megacache: %s", res.reason)
    return True


def _bundle_artifacts(f: _Follow, ref: BlobRef) -> torch_env.Artifacts:
    """The entry's bundle as torch's artifacts: fetched into the node cache (verified
    against its digest, once per node) and read as the load reads it."""
    path, _ = f.node.fetch(ref.digest, ref.size,
                           functools.partial(f.remote.download_blob, ref.digest, ref.size))
    return _artifacts_of(read_bundle(ref, path, f.config.max_raw_bytes))


def _artifacts_of(raw: bytes) -> torch_env.Artifacts:
    artifacts = torch_env.read_artifacts(raw)
    if artifacts is None:
        raise PackError("torch could not read a Mega-Cache bundle")
    return artifacts


def _lacking(theirs: torch_env.Artifacts, ours: torch_env.Artifacts) -> torch_env.Artifacts:
    """Our artifacts the entry's bundle lacks (compared by type and key). Our precompiled
    Dynamo entries join only a bundle without any: two processes numbered theirs and ours,
    and their ids could clash in one bundle."""
    if theirs.get(precompile.ARTIFACT_TYPE):
        ours = torch_env.without(ours, precompile.ARTIFACT_TYPE)
    have = {(kind, k) for kind, ks in torch_env.keys_of(theirs).items() for k in ks}
    return {kind: [a for a in items if (kind, a.key) not in have]
            for kind, items in ours.items()}


def _merged_bundle(node: NodeCache, ref: BlobRef, theirs: torch_env.Artifacts,
                   artifacts: torch_env.Artifacts, counts: dict[str, int]) -> BlobRef:
    """The merged artifacts (`counts` of each type) as a bundle blob; its precompile meta
    is the claimant's when the precompiled entries are theirs (`_lacking`), else ours."""
    meta = dict(ref.meta) if theirs.get(precompile.ARTIFACT_TYPE) \
        else precompile.producer_meta(counts)
    return bundle_blob(node, torch_env.to_bytes(artifacts), meta)


def _extra_blobs(f: _Follow, entry: Manifest, kernels: bool) -> list[BlobRef]:
    """Our kernels pack (when `kernels`: the entry has none) and our toolchain pack when
    the entry has none, to add to it. A kernels pack the entry has is kept as it is:
    merging ours into it would need its files unpacked here; a run that loads the entry
    and compiles what it lacks adds those (its republish packs the placed kernels too)."""
    extra = []
    if kernels:
        extra.append(_pack_blob(f.node, "kernels", f.snap.kernels,
                                relocate.recorder().ids_for(f.snap.kernels)))
    if f.config.ship_toolchain and entry.blob("toolchain") is None:
        toolchain = _toolchain_blob(f.remote, f.node, f.first)
        if toolchain is not None:
            extra.append(toolchain)
    return extra


def claim_holder() -> str:
    """A name for this process on a publish claim: host, pid and a random part (a pid
    is reused, a host name repeats in containers), in the server's id alphabet."""
    import re
    import socket

    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].strip(".-") or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


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


def _pack_blob(node: NodeCache, role: str, files: dict[str, Path], ids: dict[str, str],
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


def _toolchain_blob(remote: RemoteCache, node: NodeCache, first: Track) -> BlobRef | None:
    """The precompiled header pack, reusing one already stored when it holds our files.

    The header is model-independent but g++ does not write it byte-identically twice, so
    content addressing alone would store a new ~21 MB copy per cold producer. Its
    path-free content (identities of header text + flags) is recorded in the blob's
    meta: a stored pack with the same contents and build facts is the same toolchain,
    wherever its producer's torch was installed.
    """
    files = _files(torch_env.header_dir(), TOOLCHAIN_SUFFIXES, exclude=("locks",))
    if not files:
        return None
    ids = relocate.recorder().ids_for(files)
    files = relocate.dedupe(files, ids)
    contents = sha256_hex(",".join(sorted(relocate.content_ids(files, ids))).encode())
    loaded = [first.load.entry] if first.load.entry is not None else []
    try:
        stored = remote.list_entries(env=first.fp.env, hw=first.fp.hw, limit=20)
    except Exception:
        stored = []
    for entry in loaded + stored:
        blob = entry.blob("toolchain")
        if blob is not None and blob.meta.get("contents") == contents \
                and not relocate.refusal(blob.meta):
            return blob
    return _pack_blob(node, "toolchain", files, ids, contents=contents)


def build_manifest(fp: Fingerprint, blobs: list[BlobRef], counts: dict[str, int],
                   compile_s: float, loaded: Manifest | None = None) -> Manifest:
    """cold_compile_s stays the cold time: a partly warm run only raises it, never lowers."""
    cold = compile_s if loaded is None else max(compile_s, loaded.cold_compile_s)
    return Manifest(
        key=fp.key(), blobs=blobs, fingerprint=fp,
        torch_version=torch_env.torch_version(), triton_version=torch_env.triton_version(),
        artifact_counts=counts, cold_compile_s=round(cold, 3),
        created_at=datetime.now(timezone.utc),
        producer={"client": f"megacache {__version__}", "rank": os.environ.get("RANK", "0")},
    )


def upload_blobs(remote: RemoteCache, node: NodeCache, blobs: list[BlobRef],
                 progress: Progress | None = None) -> int:
    """Upload the blobs the server lacks (HEAD before PUT); returns the bytes sent."""
    sent = 0
    for blob in blobs:
        if not remote.has_blob(blob.digest):
            remote.upload_blob(node.path(blob.digest), blob.digest, progress)
            sent += blob.size
    return sent


def _files(root: Path, suffixes: tuple[str, ...], exclude: tuple[str, ...]) -> dict[str, Path]:
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
