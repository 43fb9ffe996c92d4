"""The publish side of a session: what this run has that its entries lack, and its upload.

What a run ships is what torch saved, plus what it loaded from exact hits (a graph served
from the cache is not saved again), plus its compiled kernels and the toolchain headers, as
content-addressed blobs; each fingerprint the process compiled under then gets its own
entry naming them. A first publish of a key is claimed (`claims.py`) so that one node of a
cold fleet uploads; the blobs and entry writes themselves are `shipping.py`'s. Every
function raises on trouble: the session decides what a failure costs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from megacache_client.config import ClientConfig
from megacache_client.results import Snapshot, Track
from megacache_client.steps import claims, shipping
from megacache_client.steps.load import KERNEL_SUFFIXES, read_bundle
from megacache_client.torch import env as torch_env
from megacache_client.torch import megacache_io, precompile, ranks, relocate
from megacache_client.transport.client import RemoteCache
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire.manifest import BlobRef

log = logging.getLogger("megacache")

# -- snapshot: what this run has that its entries lack ------------------------------------
def snapshot(precompile_keys: dict[str, list[str]] | None, tracks: Sequence[Track],
             node: NodeCache, cap: int, *, wait_verify: bool = True,
             on_verdicts: Callable[[], None] | None = None) -> tuple[Snapshot | None, str]:
    """This run's artifacts and kernels with the tracks whose entries lack some of them
    (None when none lacks anything, or torch recorded nothing), and why its precompiled
    Dynamo output is not shipped ("" when it is). Precompile artifacts still being checked
    (`wait_verify` False) are left out; `on_verdicts` runs when their check ends.

    `precompile_keys`: torch's precompile key of each compiled callable, None when this
    process records no precompiled Dynamo output. Cheap when nothing is lacking (a warm
    run's settled point): torch's save is incremental and says its keys, so the bundle is
    read back (deserialised) only to ship it. Kernels
    compare by path-free identity: a consumer whose torch is elsewhere holds the entry's
    kernels under other names, and must not publish them back as new (thrash).
    """
    saved = megacache_io.save_bundle(precompile=precompile_keys is not None)
    if saved is None:
        for track in tracks:
            track.publish.reason = "torch recorded no cache artifacts"
        return None, ""
    raw, keys = saved
    artifacts: megacache_io.Artifacts | None = None
    note = ""
    refused: frozenset[str] = frozenset()
    refused_at: float | None = None
    withheld = {k for t in tracks if t.load.outcome == "hit" for k in t.load.withheld}
    theirs = _withheld_precompile_meta(tracks)
    if theirs is not None:  # another rank's Dynamo output stays; ours does not join it
        precompile_keys = None
        keys = {kind: ks for kind, ks in keys.items() if kind != precompile.ARTIFACT_TYPE}
        note = ("the entry's precompiled Dynamo output is another rank's: this rank's is "
                "not shipped (it traces Dynamo, and loads the rest)")
    if keys.get(precompile.ARTIFACT_TYPE):  # what may ship decides what is lacking
        artifacts, note = _shippable(raw, precompile_keys)
        # checked before `lacking`: an artifact that fails is never lacking, or every
        # consumer that traces it would publish again (the verdict is kept per content,
        # and the loaded entry's producer's refusals stand without a check)
        hits = [t.load for t in tracks if t.load.outcome == "hit"]
        metas = [load.bundle.ref.meta for load in hits if load.bundle is not None]
        refused_at = precompile.refused_since(metas)  # carried on, never renewed
        artifacts, unverified, refused = precompile.verified_for_shipping(
            artifacts, {k for load in hits for kind, k in load.loaded_keys
                        if kind == precompile.ARTIFACT_TYPE},
            refused_before=precompile.refused_by(metas),
            wait=wait_verify, on_verdicts=on_verdicts)
        note = note or unverified
        keys = megacache_io.keys_of(artifacts)
    kernels = shipping.find_files(torch_env.inductor_cache_dir(), KERNEL_SUFFIXES,
                                  exclude=("triton", "locks"))
    ids = relocate.recorder().ids_for(kernels)
    kernels = relocate.dedupe(kernels, ids)
    new_keys = {(kind, k) for kind, ks in keys.items() for k in ks} - withheld
    kernel_ids = relocate.content_ids(kernels, ids)
    lacking = [t for t in tracks if _lacks(t, tracks, new_keys, kernel_ids, node, cap)]
    if not lacking:
        return None, note
    if artifacts is None:
        artifacts, note = _shippable(raw, precompile_keys)
        note = note if theirs is None else note or "another rank's precompiled Dynamo kept"
    if theirs is not None:
        artifacts = megacache_io.without(artifacts, precompile.ARTIFACT_TYPE)
    loaded = _loaded_artifacts(tracks, node, cap)
    artifacts, bindings = _bind_to_rank(ranks.less(artifacts, withheld), loaded, tracks)
    artifacts = megacache_io.merged(loaded, artifacts)
    counts = {kind: len(ks) for kind, ks in megacache_io.keys_of(artifacts).items()}
    meta = precompile.producer_meta(artifacts, refused, refused_at) if theirs is None \
        else theirs
    return Snapshot(megacache_io.to_bytes(artifacts), counts, kernels,
                    torch_env.compile_seconds(), lacking, new_keys, kernel_ids,
                    {**meta, **({ranks.META: bindings} if bindings else {})}), note


def _withheld_precompile_meta(tracks: Sequence[Track]) -> dict[str, str] | None:
    """The precompile meta of a loaded bundle whose Dynamo output is another rank's (it is
    kept, as it was, in any entry this run rewrites), or None when there is none."""
    for t in tracks:
        if t.load.outcome == "hit" and t.load.bundle is not None and any(
                kind == precompile.ARTIFACT_TYPE for kind, _ in t.load.withheld):
            return {k: v for k, v in t.load.bundle.ref.meta.items()
                    if k.startswith("precompile_")}
    return None


def _bind_to_rank(ours: megacache_io.Artifacts, loaded: megacache_io.Artifacts,
                  tracks: Sequence[Track]) -> tuple[megacache_io.Artifacts, str]:
    """Our artifacts less those whose rank binding does not fit the bundle's meta, and the
    bindings of the bundle to write: the loaded bundles' (other ranks' stay theirs) and
    ours at this rank's position (`ranks.bound`: only what this process compiled)."""
    have = {(kind, a.key) for kind, items in loaded.items() for a in items}
    own = ranks.less(ours, have)
    where = ranks.position()
    metas = [t.load.bundle.ref.meta for t in tracks
             if t.load.outcome == "hit" and t.load.bundle is not None]
    rendered, left = ranks.render(ranks.merged(*metas, ours=ranks.bound(own, where),
                                               where=where))
    if left:
        dropped = {(kind, a.key) for kind, items in own.items() for a in items
                   if ranks.short((kind, a.key)) in left}
        log.info("megacache: %d rank-bound artifact(s) not shipped: their binding does "
                 "not fit the bundle's meta", len(dropped))
        ours = ranks.less(ours, dropped)
    return ours, rendered


def _shippable(raw: bytes, precompile_keys: dict[str, list[str]] | None
               ) -> tuple[megacache_io.Artifacts, str]:
    """torch's Mega-Cache bytes as artifacts to ship, and why its precompiled Dynamo output
    is not among them ("" when it is)."""
    artifacts = megacache_io.read_artifacts(raw)
    if artifacts is None:
        raise ValueError("torch could not read its own Mega-Cache bytes")
    return precompile.for_shipping(artifacts, precompile_keys or {})


def shipped(snap: Snapshot, done: Sequence[Track]) -> None:
    """Remember, on each track whose entry holds the snapshot now, what it shipped: a later
    round that has nothing more uploads nothing (a process publishes the same content
    once)."""
    for track in done:
        track.publish.shipped = set(snap.keys)
        track.publish.shipped_kernels = set(snap.kernel_ids)


def _loaded_artifacts(tracks: Sequence[Track], node: NodeCache, cap: int
                      ) -> megacache_io.Artifacts:
    """What this process loaded from exact hits, read again from the node cache.

    torch's save holds only what this process recorded, and a graph served by a
    precompiled Dynamo entry is never looked up in the FX-graph or AOTAutograd caches, so
    a republish built from the save alone would drop every graph the run loaded but did
    not compile. Fallback entries are left out: they are another code version's.
    """
    out: megacache_io.Artifacts = {}
    seen: set[str] = set()
    for track in tracks:
        bundle = track.load.bundle
        if track.load.outcome != "hit" or bundle is None or bundle.ref.digest in seen:
            continue
        ref = bundle.ref
        seen.add(ref.digest)
        if not NodeCache.was_verified(bundle.path, ref.digest, ref.size):
            continue  # changed on disk since it was admitted
        artifacts = megacache_io.read_artifacts(read_bundle(bundle, cap)) or {}
        kept = _loaded_with(tracks, ref) | {k for t in tracks for k in t.load.withheld}
        out = megacache_io.merged(out, ranks.only(artifacts, kept))
    return out


def _lacks(track: Track, tracks: Sequence[Track], new_keys: set[tuple[str, str]],
           kernel_ids: set[str], node: NodeCache, cap: int) -> bool:
    """Whether this track's entry should be (re)written with this run's artifacts."""
    load, res = track.load, track.publish
    # bad bytes the server confirmed and took out of service: this run's clean bundle is
    # what replaces them; after any other failed load, publishing is not to be trusted
    healed = load.outcome == "invalid" and load.reported in ("quarantined", "withdrawn")
    # a load that gave torch nothing (the server down or slow when it started) left this
    # run's compile all its own: it publishes once the server answers
    unreached = load.outcome == "error" and not load.loaded_keys
    if load.outcome in ("invalid", "error") and not healed and not unreached:
        res.reason = f"not publishing after a failed load ({load.outcome})"
        return False
    if res.shipped or res.shipped_kernels:  # an earlier round of this process wrote it
        if new_keys <= res.shipped and kernel_ids <= res.shipped_kernels:
            res.reason = res.reason or "an earlier round shipped everything this run compiled"
            return False
        return True
    if load.outcome == "hit" and load.entry is not None \
            and ranks.graphs_in(new_keys) <= _loaded_with(tracks, load.entry.blob("megacache")) \
            and kernel_ids <= shipping.entry_kernel_ids(load.entry, node, cap):
        # its own profile of automatic dynamic (torch keys it by rank) or Dynamo output
        # (traced where the entry's was another rank's) alone is no reason to rewrite it
        res.reason = "the loaded entry already has every graph this run compiled"
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


# -- upload: the blobs once, then an entry per track --------------------------------------
def upload(snap: Snapshot, config: ClientConfig, node: NodeCache, first: Track,
           holder: str = "") -> list[Track]:
    """Upload the blobs once, then write each track's entry (its own key, its own etag);
    returns the tracks whose entry now holds what the snapshot has (written, or found
    complete). `first` is the session's first track: its entry and fingerprint find a
    stored toolchain pack to reuse.

    A first publish of a key is claimed first (`holder` names this process): when a cold
    fleet starts, every node compiles and would upload the same ~20 MB-to-GBs only to lose
    the conditional PUT; the claimant uploads, the others skip. A skipped track then waits
    (within `publish_wait_s`) for the claimant's entry and adds what this run compiled that
    it lacks, or takes the key over if the claim lapses with no entry written (the
    claimant died). A republish (adding to an entry this run loaded or wrote) needs no
    claim: its conditional PUT orders it, and when another writer's version stands in the
    way, this run adds to that version what it lacks (the union, as a follower does).
    """
    deadline = time.monotonic() + config.publish_wait_s
    done: list[Track] = []
    with RemoteCache(config) as remote:
        _keep_off_untrusted(remote, snap, config)
        claimed, skipped = claims.claim_first_publishes(
            remote, snap, holder, config.claim_lease_s) if holder else ([], [])
        try:
            if snap.tracks:
                lost = shipping.upload_and_write(remote, snap, config, node, first)
                done += [t for t in snap.tracks if t not in lost]
                skipped += [(t, "") for t in lost if t.publish.etag or t.load.etag]
        finally:
            claims.release_claims(remote, claimed, holder)
        for track, other in skipped:
            follow = claims.Follow(remote, snap, config, node, first, holder, deadline)
            if claims.follow(follow, track, other):
                done.append(track)
    return done


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


