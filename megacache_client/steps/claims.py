"""One upload per key across a fleet: a first publish is claimed, the others follow.

When a cold fleet starts, every node compiles and would upload the same ~20 MB-to-GBs only
to lose the conditional PUT. A publisher first claims the key (a lease); the claimant
uploads, the others skip, then wait (within `publish_wait_s`) for its entry and add what
their own run compiled that it lacks, or take the key over when the claim lapses with no
entry written (the claimant died).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from megacache_client.config import ClientConfig
from megacache_client.results import Snapshot, Track
from megacache_client.steps.fetch import fetch_blob
from megacache_client.steps.load import read_bundle
from megacache_client.steps.nodecache import NodeCache
from megacache_client.steps.shipping import (
    build_manifest,
    bundle_blob,
    pack_blob,
    toolchain_blob,
    upload_and_write,
    upload_blobs,
)
from megacache_client.steps.verify import ServedEntry
from megacache_client.torch import env as torch_env
from megacache_client.torch import precompile, relocate
from megacache_client.torch.packs import PackError
from megacache_client.transport.client import RemoteCache, TransportError, UntrustedWriterError
from megacache_client.wire.manifest import BlobRef, Manifest, sha256_hex

log = logging.getLogger("megacache")


def claim_holder() -> str:
    """A name for this process on a publish claim: host, pid and a random part (a pid
    is reused, a host name repeats in containers), in the server's id alphabet."""
    import re
    import socket

    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].strip(".-") or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"



def claim_first_publishes(remote: RemoteCache, snap: Snapshot, holder: str, lease_s: float
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
        if track.publish.merged:  # add again to the entry we added to: never replace it
            skipped.append((track, ""))
            continue
        if track.publish.etag or (track.load.outcome == "hit" and track.load.etag):
            kept.append(track)  # a republish of the entry this run loaded or wrote
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


def release_claims(remote: RemoteCache, keys: list[str], holder: str) -> None:
    """Give up our claims once written (or given up): the next publisher need not wait
    for the lease to run out."""
    for key in keys:
        try:
            remote.release_claim(key, holder=holder)
        except Exception as exc:  # the lease runs out on its own
            log.debug("megacache: releasing the claim on %s failed: %s", key[:12], exc)



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
class Follow:
    """What following a claimant needs: this publish's parts and when to give up."""

    remote: RemoteCache
    snap: Snapshot
    config: ClientConfig
    node: NodeCache
    first: Track
    holder: str
    deadline: float


def follow(f: Follow, track: Track, other: str) -> bool:
    """Wait for the claimant's entry (until `f.deadline`), then add what it lacks; True
    when the entry then holds what this run has.

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
                return False
            time.sleep(wait)
        return True
    except UntrustedWriterError:
        track.publish.reason = (f"{_skip_note(other)}; the entry written is from an "
                                "untrusted writer: not adding to it")
    except Exception as exc:
        track.publish.reason = (f"{_skip_note(other)}; then publishing what the entry "
                                f"lacks failed: {type(exc).__name__}: {exc}")[:500]
        log.warning("megacache: %s", track.publish.reason)
    return False


def _follow_step(f: Follow, track: Track, other: str) -> bool:
    """One look: add to the entry if it is there; take the key over if the claim is free
    and there is still no entry (the claimant died or gave up). False: look again later
    (the claim is still held, or another writer changed the entry while we merged)."""
    key = track.fp.key()
    got = f.remote.get_entry(key)
    if got is not None:
        return _add_lacking(f, track, other, got)
    if f.remote.claim(key, holder=f.holder, lease_s=f.config.claim_lease_s) is not None:
        return False
    try:
        if not _vacant(f.remote, key):
            return False  # written just now: the next look adds to it
        one = dataclasses.replace(f.snap, tracks=[track])
        upload_and_write(f.remote, one, f.config, f.node, f.first)
    finally:
        release_claims(f.remote, [key], f.holder)
    if not track.publish.published:
        return False  # another producer wrote first: add to theirs
    whose = f"the claim of {other}" if other else "the claim"
    track.publish.reason = (f"{whose} lapsed with no entry written: took the key over and "
                            f"{track.publish.reason}")
    return True


def _add_lacking(f: Follow, track: Track, other: str, served: ServedEntry) -> bool:
    """Write over the entry read (If-Match) a merged bundle: its artifacts and those of
    ours it lacks, its other blobs kept; upload only our new blobs. True when done
    (written, or nothing to add); False when another writer changed it meanwhile."""
    res, entry, etag = track.publish, served.manifest, served.etag
    res.key = entry.key
    ref = entry.blob("megacache")
    if ref is None:
        raise PackError("the claimant's entry has no megacache bundle")
    same = ref.raw_sha256 is not None and ref.raw_sha256 == sha256_hex(f.snap.raw)
    theirs = {} if same else _bundle_artifacts(f, served, ref)
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
    bundle = _merged_bundle(f.node, ref, theirs, artifacts, f.snap.meta) \
        if artifacts is not None else ref
    blobs = [bundle, *(b for b in entry.blobs if b.role != "megacache"), *extra]
    ours = [b for b in (bundle, *extra) if b is not ref]
    sent = upload_blobs(f.remote, f.node, ours)
    res.bytes_up += sent
    manifest = build_manifest(track.fp, blobs, counts, f.snap.compile_s, entry)
    written = f.remote.put_entry(manifest, if_match=etag)
    if written is None:
        return False
    res.etag = written
    added = sum(len(items) for items in new.values())
    what = [f"{added} artifact(s)"] if added else []
    what += [f"its {b.role} pack" for b in extra]
    res.published = res.merged = True
    res.reason = (f"{_skip_note(other)}; added to the claimant's entry what this run compiled "
                  f"and it lacked: {' and '.join(what)} ({sent} bytes uploaded)")
    log.info("megacache: %s", res.reason)
    return True


def _bundle_artifacts(f: Follow, entry: ServedEntry, ref: BlobRef) -> torch_env.Artifacts:
    """The entry's bundle as torch's artifacts: fetched into the node cache (verified
    against its digest, once per node), admitted by the gate and read as the load reads
    it (torch deserialises it: it is the claimant's code)."""
    path, _ = fetch_blob(f.remote, f.node, ref)
    admitted = f.remote.gate.admit(entry, "megacache", path)
    return _artifacts_of(read_bundle(admitted, f.config.max_raw_bytes))


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
                   artifacts: torch_env.Artifacts, ours: dict[str, str]) -> BlobRef:
    """The merged artifacts as a bundle blob; its precompile meta is the claimant's when
    the precompiled entries are theirs (`_lacking`), else ours (`ours`: our snapshot's,
    whose refusals it keeps)."""
    meta = dict(ref.meta) if theirs.get(precompile.ARTIFACT_TYPE) \
        else precompile.producer_meta(artifacts, precompile.refused_by([ours]))
    return bundle_blob(node, torch_env.to_bytes(artifacts), meta)


def _extra_blobs(f: Follow, entry: Manifest, kernels: bool) -> list[BlobRef]:
    """Our kernels pack (when `kernels`: the entry has none) and our toolchain pack when
    the entry has none, to add to it. A kernels pack the entry has is kept as it is:
    merging ours into it would need its files unpacked here; a run that loads the entry
    and compiles what it lacks adds those (its republish packs the placed kernels too)."""
    extra = []
    if kernels:
        extra.append(pack_blob(f.node, "kernels", f.snap.kernels,
                                relocate.recorder().ids_for(f.snap.kernels)))
    if f.config.ship_toolchain and entry.blob("toolchain") is None:
        toolchain = toolchain_blob(f.remote, f.node, f.first)
        if toolchain is not None:
            extra.append(toolchain)
    return extra


