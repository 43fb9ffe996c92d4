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
from pathlib import Path

from megacache_client.config import ClientConfig
from megacache_client.results import Snapshot, Track
from megacache_client.steps.fetch import fetch_blob
from megacache_client.steps.load import read_bundle
from megacache_client.steps.shipping import (
    build_manifest,
    bundle_blob,
    entry_kernel_ids,
    pack_blob,
    toolchain_blob,
    upload_and_write,
    upload_blobs,
)
from megacache_client.torch import megacache_io, precompile, ranks, relocate
from megacache_client.torch.packs import MAX_KERNEL_PACKS, PackError, pack_kind
from megacache_client.transport.client import RemoteCache, TransportError, UntrustedWriterError
from megacache_client.transport.nodecache import NodeCache
from megacache_client.transport.trust import ServedEntry
from megacache_client.wire.manifest import BlobRef, Manifest, sha256_hex

log = logging.getLogger("megacache")


def claim_holder() -> str:
    """A name for this process on a publish claim: host, pid and a random part (a pid
    is reused, a host name repeats in containers), in the server's id alphabet."""
    return f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"



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
            other = claim(remote, key, holder, lease_s)
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


def claim(remote: RemoteCache, key: str, holder: str, lease_s: float) -> str | None:
    """Claim `key` for `holder`; None when granted, else who holds it. A claim held by a
    process of this host that is gone (SIGKILLed, say, in the middle of its publish) is
    released for it first: its restart on the same node would otherwise wait out the lease
    or `publish_wait_s` at its exit for an upload that will never come."""
    other = remote.claim(key, holder=holder, lease_s=lease_s)
    if other and holder_gone(other):
        log.info("megacache: the claim on %s was held by %s, a process of this host that "
                 "is gone: released for it", key[:12], other)
        remote.release_claim(key, holder=other)
        other = remote.claim(key, holder=holder, lease_s=lease_s)
    return other


def holder_gone(holder: str) -> bool:
    """Whether a claim's holder (`claim_holder()`: host, pid, random part) was a process
    of this host that no longer runs. Another host's, or a pid still in use, is not."""
    parts = holder.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    host, pid = parts[0], int(parts[1])
    if host != _host() or pid == os.getpid() or pid <= 1:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _host() -> str:
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].strip(".-") or "host"


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
    if claim(f.remote, key, f.holder, f.config.claim_lease_s) is not None:
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
    kernels = _lacking_kernels(f, entry) if any(new.values()) or not _kernel_roles(entry) \
        else {}
    if not any(new.values()) and not kernels:
        res.reason = (f"{_skip_note(other)}; the claimant's entry already has everything "
                      "this run compiled")
        return True
    artifacts = megacache_io.merged(theirs, new) if any(new.values()) else None
    if artifacts is not None and len(megacache_io.to_bytes(artifacts)) > f.config.max_raw_bytes:
        res.reason = (f"{_skip_note(other)}; adding this run's graphs would take the entry's "
                      f"bundle past MEGACACHE_MAX_RAW_BYTES ({f.config.max_raw_bytes}): "
                      "not added (this rank compiles them on every new machine)")
        log.warning("megacache: %s", res.reason)
        return True
    extra = _extra_blobs(f, entry, kernels)
    counts = {kind: len(ks) for kind, ks in megacache_io.keys_of(artifacts).items()} \
        if artifacts is not None else dict(entry.artifact_counts)
    adding = {(kind, a.key) for kind, items in new.items() for a in items}
    bundle = _merged_bundle(f.node, ref, theirs, artifacts, ranks.restricted(f.snap.meta, adding)
                            | {k: v for k, v in f.snap.meta.items() if k != ranks.META}) \
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
    kinds = ", ".join(f"{len(items)} {kind}" for kind, items in sorted(new.items()) if items)
    what = [f"{added} artifact(s) ({kinds})"] if added else []
    what += [f"a {b.role} pack" for b in extra]
    res.published = res.merged = True
    res.reason = (f"{_skip_note(other)}; added to the claimant's entry what this run compiled "
                  f"and it lacked: {' and '.join(what)} ({sent} bytes uploaded)")
    log.info("megacache: %s", res.reason)
    return True


def _bundle_artifacts(f: Follow, entry: ServedEntry, ref: BlobRef) -> megacache_io.Artifacts:
    """The entry's bundle as torch's artifacts: fetched into the node cache (verified
    against its digest, once per node), admitted by the gate and read as the load reads
    it (torch deserialises it: it is the claimant's code)."""
    path, _ = fetch_blob(f.remote, f.node, ref)
    admitted = f.remote.gate.admit(entry, "megacache", path)
    return _artifacts_of(read_bundle(admitted, f.config.max_raw_bytes))


def _artifacts_of(raw: bytes) -> megacache_io.Artifacts:
    artifacts = megacache_io.read_artifacts(raw)
    if artifacts is None:
        raise PackError("torch could not read a Mega-Cache bundle")
    return artifacts


def _lacking(theirs: megacache_io.Artifacts, ours: megacache_io.Artifacts
             ) -> megacache_io.Artifacts:
    """Our artifacts the entry's bundle lacks (compared by type and key), when some are
    compiled graphs: a rank that compiled the same graphs as the entry's producer (data
    parallel) adds nothing, not even its own automatic-dynamic profile or Dynamo output.
    Our precompiled Dynamo entries join only a bundle without any (two processes numbered
    theirs and ours, and their ids could clash in one bundle)."""
    have = {(kind, k) for kind, ks in megacache_io.keys_of(theirs).items() for k in ks}
    new = {kind: [a for a in items if (kind, a.key) not in have]
           for kind, items in ours.items()}
    if not ranks.graphs_in((kind, a.key) for kind, items in new.items() for a in items):
        return {}  # riders alone (`ranks.RIDERS`): nothing worth an upload
    if theirs.get(precompile.ARTIFACT_TYPE):
        new = megacache_io.without(new, precompile.ARTIFACT_TYPE)
    return new


def _merged_bundle(node: NodeCache, ref: BlobRef, theirs: megacache_io.Artifacts,
                   artifacts: megacache_io.Artifacts, ours: dict[str, str]) -> BlobRef:
    """The merged artifacts as a bundle blob; its precompile meta is the claimant's when
    the precompiled entries are theirs (`_lacking`), else ours (`ours`: our snapshot's,
    whose refusals it keeps)."""
    meta = {k: v for k, v in ref.meta.items() if k.startswith("precompile_")} \
        if theirs.get(precompile.ARTIFACT_TYPE) \
        else precompile.producer_meta(artifacts, precompile.refused_by([ours]),
                                      precompile.refused_since([ours]))
    bindings, _ = ranks.render(ranks.merged(ref.meta, ours))  # ours: only what we add
    if bindings:
        meta[ranks.META] = bindings
    return bundle_blob(node, megacache_io.to_bytes(artifacts), meta)


def _kernel_roles(entry: Manifest) -> list[str]:
    return [b.role for b in entry.blobs if pack_kind(b.role) == "kernels"]


def _lacking_kernels(f: Follow, entry: Manifest) -> dict[str, Path]:
    """Our kernels the entry's kernel packs lack (its packs fetched into the node cache to
    read their index: a stage whose graphs the entry lacked compiled kernels it lacks
    too); all of ours when it has none; none when kernels do not ship or it holds
    `MAX_KERNEL_PACKS` already (a process that rewrites the entry packs them as one)."""
    roles = _kernel_roles(entry)
    if not f.config.ship_kernels or not f.snap.kernels or len(roles) >= MAX_KERNEL_PACKS:
        return {}
    if not roles:
        return dict(f.snap.kernels)
    for role in roles:
        blob = entry.blob(role)
        if blob is not None:
            fetch_blob(f.remote, f.node, blob)
    have = entry_kernel_ids(entry, f.node, f.config.max_raw_bytes)
    ids = relocate.recorder().ids_for(f.snap.kernels)
    return {name: path for name, path in f.snap.kernels.items()
            if relocate.content_ids([name], ids).isdisjoint(have)}


def _extra_blobs(f: Follow, entry: Manifest, kernels: dict[str, Path]) -> list[BlobRef]:
    """A pack of our kernels the entry lacks (its first kernel pack, or one beside the
    packs it has: `kernels-N`), and our toolchain pack when the entry has none."""
    extra = []
    if kernels:
        roles = _kernel_roles(entry)
        role = f"kernels-{len(roles) + 1}" if roles else "kernels"
        extra.append(pack_blob(f.node, role, kernels, relocate.recorder().ids_for(kernels)))
    if f.config.ship_toolchain and entry.blob("toolchain") is None:
        toolchain = toolchain_blob(f.remote, f.node, f.first)
        if toolchain is not None:
            extra.append(toolchain)
    return extra


