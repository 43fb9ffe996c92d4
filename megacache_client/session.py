"""The client lifecycle inside a trainer: fingerprint → fetch → verify → load → publish → report.

Each step is a method of `Session`. The rule over all of them: nothing the cache does may
hurt the trainer. Any failure is caught, logged as one clear warning, and the run compiles
cold; only `mode="required"` turns a failure into an exception. The load step has a total
deadline (`load_deadline_s`), so a server that accepts connections and never answers costs
seconds, not minutes.

A process may compile several things (a model and its loss, a trainer and its EMA copy):
each distinct fingerprint is a `Track` with its own entry, load and publish. Torch keeps one
Mega-Cache per process, so every published entry carries the process's whole bundle: the
blobs are stored once (same bytes, same digest) and each key gets its own entry.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from megacache_client import precompile, relocate, start_clock, torch_env, vec_isa
from megacache_client._version import __version__
from megacache_client.config import ClientConfig
from megacache_client.events import Event, Outcome
from megacache_client.fingerprint import COMPONENTS, describe, differing
from megacache_client.fingerprint import compute as compute_fingerprint
from megacache_client.manifest import BlobRef, Fingerprint, Manifest, sha256_file, sha256_hex
from megacache_client.nodecache import NodeCache
from megacache_client.packs import (
    PackError,
    compress_bytes,
    pack_names,
    read_index,
    write_pack,
)
from megacache_client.prefetch import (
    KERNEL_SUFFIXES,
    TOOLCHAIN_SUFFIXES,
    Prefetcher,
    PrefetchResult,
    place,
    read_bundle,
    skip_reason,
)
from megacache_client.transport import (
    CircuitOpenError,
    CorruptBlobError,
    Deadline,
    Progress,
    RemoteCache,
    UntrustedEntryError,
)

log = logging.getLogger("megacache")


class MegacacheError(RuntimeError):
    """Raised only in `required` mode, when the cache could not be used."""


@dataclass
class LoadResult:
    outcome: Outcome | None = None
    key: str | None = None
    entry: Manifest | None = None
    etag: str | None = None
    differing: list[str] = field(default_factory=list)
    reason: str = ""
    bytes_down: int = 0
    loaded_keys: set[tuple[str, str]] = field(default_factory=set)
    placed: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)
    precompile: str = ""
    """Why the entry's precompiled Dynamo output was not loaded ("" when loaded or absent)."""

    def timer(self) -> Callable[[str], None]:
        """Returns `mark(name)`: records the seconds since the previous mark under `name`."""
        last = [time.monotonic()]

        def mark(name: str) -> None:
            now = time.monotonic()
            self.steps[name] = round(now - last[0], 4)
            last[0] = now

        return mark


@dataclass
class PublishResult:
    published: bool = False
    reason: str = ""
    bytes_up: int = 0
    key: str | None = None


@dataclass
class Track:
    """One fingerprint this process compiled under: its entry's load and its publish."""

    fp: Fingerprint
    load: LoadResult
    publish: PublishResult = field(default_factory=PublishResult)


@dataclass
class Snapshot:
    """This run's artifacts, taken once, and the tracks whose entries lack some of them."""

    raw: bytes
    counts: dict[str, int]
    kernels: dict[str, Path]
    compile_s: float
    tracks: list[Track]


class Session:
    """One process's use of the cache: one track per distinct fingerprint it compiles."""

    def __init__(self, config: ClientConfig, *, model: str | None = None,
                 code: str | None = None, compile_options: dict[str, Any] | None = None,
                 fingerprint: Fingerprint | None = None) -> None:
        self.config = config
        self.model = model or config.model
        self.code = code or config.code
        self.compile_options = compile_options
        self.tracks: dict[str, Track] = {}
        self._fixed_fp = fingerprint
        self._no_track = Track(fingerprint or Fingerprint(model="none", code="none"),
                               LoadResult())
        self.node = NodeCache(config.node_cache_dir, config.lock_timeout_s)
        self._closed = False
        self._warned = False
        self._publisher: threading.Thread | None = None
        self._lock = threading.RLock()
        self.clock = start_clock.TimeToStart()
        self.prefetcher: Prefetcher | None = None
        self.precompile_off = ""
        """Why caching precompile is off in this process ("" when on)."""
        self.precompile_shared = ""
        """Why this process's precompiled Dynamo output was not shipped ("" when it was)."""
        self._precompile_keys: dict[str, list[str]] = {}
        """torch's precompile key of each compiled callable -> the callables wrapped under it."""

    def start(self) -> Session:
        """Called when the client is enabled: precompile on, clock started, prefetch begun.

        Runs before the trainer's first torch.compile, so the prefetch thread overlaps the
        trainer's initialisation and torch records Dynamo's output from the first compile.
        """
        self.clock.mark_enabled()
        try:
            self.precompile_off = precompile.turn_on(self.config)
        except Exception as exc:
            self.precompile_off = f"could not turn precompile on: {exc}"
        if self.config.prefetch and self.prefetcher is None:
            self.prefetcher = Prefetcher(self.config, self.node).start()
        return self

    # -- the first track stands for the session (one model per process is the usual case)
    @property
    def _first(self) -> Track:
        return next(iter(self.tracks.values()), self._no_track)

    @property
    def fp(self) -> Fingerprint | None:
        return self._first.fp if self.tracks else None

    @property
    def load_result(self) -> LoadResult:
        return self._first.load

    @property
    def publish_result(self) -> PublishResult:
        return self._first.publish

    # -- entry points -------------------------------------------------------------------
    def before_compile(self, target: Any, options: dict[str, Any]) -> None:
        """Called by the torch.compile hook: load each fingerprint once, before it compiles."""
        self.load(target, options)
        found = precompile.source_id(target)  # None when precompile is off or torch can't say
        if found is not None:
            self._precompile_keys.setdefault(found[0], []).append(found[1])

    def drop_precompiled(self, target: Any, exc: Exception) -> bool:
        """torch.compile(target) failed while a precompiled package for it is on local disk:
        remove the package (the hook then compiles again, as without one). False if there
        was none: the error is the trainer's own."""
        try:
            dropped = precompile.forget_package_of(target)
        except Exception:
            return False
        if dropped:  # the rest of the bundle still serves: a note in the event, no warning
            self.precompile_shared = self.precompile_shared or (
                f"a precompiled package failed to install ({type(exc).__name__}: {exc}); "
                "Dynamo traced as usual and its output is not shipped")[:500]
            log.info("megacache: %s", self.precompile_shared)
        return dropped

    def after_compile(self, compiled: Any) -> Any:
        """Called by the torch.compile hook with its result: time the first compiled step."""
        if not self.config.enabled or self.clock.first_step_end is not None:
            return compiled
        return start_clock.watch(compiled, self.clock)

    def load(self, target: Any = None, options: dict[str, Any] | None = None) -> LoadResult:
        """Steps 1-5 for what is about to be compiled: fingerprint, find, fetch, place, load."""
        with self._lock:
            if not self.config.enabled or self._closed:
                return self.load_result
            result = LoadResult()
            started = time.monotonic()
            step = result.timer()
            try:
                fp = self.fingerprint(target, options)
            except Exception as exc:  # a model whose source cannot be read, ...
                if not self.tracks:
                    self._no_track.load = result
                self._fail(result, "error", f"fingerprint: {type(exc).__name__}: {exc}")
                return result
            result.key = fp.key()
            if result.key in self.tracks:
                return self.tracks[result.key].load
            self.tracks[result.key] = Track(fp, result)
            torch_env.set_job_id("megacache-" + result.key[:16])
            self._record_kernel_keys()
            step("fingerprint")
            try:
                prefetched = self._await_prefetch(result)
                step("prefetch")
                deadline = Deadline(self.config.load_deadline_s)
                with RemoteCache(self.config, deadline=deadline) as remote:
                    found = self._find_entry(remote, fp, result, prefetched)
                    step("find")
                    if found is not None:
                        result.entry, result.etag = found
                        paths = self._fetch_blobs(remote, result.entry, result, prefetched)
                        step("fetch")
                        self._place_artifacts(result.entry, paths, result, prefetched)
                        step("place")
                        self._load_bundle(result.entry, paths, result, prefetched)
                        step("load")
                        self._await_toolchain(result.entry, result, prefetched)
            except (CorruptBlobError, PackError) as exc:
                self._fail(result, "invalid", str(exc))
            except Exception as exc:  # never let the cache break the trainer
                self._fail(result, "error", f"{type(exc).__name__}: {exc}"
                           + self._prefetch_failure(exc))
            finally:
                result.seconds = time.monotonic() - started
                steps = result.steps
                self.clock.fetch_s = sum(steps.get(k, 0.0) for k in ("prefetch", "find", "fetch"))
                self.clock.load_s = sum(steps.get(k, 0.0)
                                        for k in ("fingerprint", "place", "load"))
            if result.outcome in ("hit", "fallback"):
                log.info("megacache: %s %s for %s in %.2fs (%s)", result.outcome,
                         (result.entry.key[:12] if result.entry else ""), fp.model,
                         result.seconds, result.reason)
            return result

    # -- step 1: fingerprint ------------------------------------------------------------
    def fingerprint(self, target: Any = None, options: dict[str, Any] | None = None
                    ) -> Fingerprint:
        """The fingerprint of compiling `target` (names given by the user win)."""
        if self._fixed_fp is not None:
            return self._fixed_fp
        return compute_fingerprint(
            namespace=self.config.namespace, target=target,
            options=options if options is not None else self.compile_options,
            model=self.model, code=self.code)

    # -- step 2: find the entry (exact, else the nearest of the same model) -------------
    def _find_entry(self, remote: RemoteCache, fp: Fingerprint, result: LoadResult,
                    prefetched: PrefetchResult | None = None) -> tuple[Manifest, str] | None:
        exact = prefetched.entry if prefetched is not None and prefetched.entry is not None \
            and prefetched.entry[0].key == fp.key() else remote.get_entry(fp.key())
        if exact is not None:
            _require_match(exact[0], fp, COMPONENTS)
            result.outcome, result.reason = "hit", "exact fingerprint"
            return exact
        candidates = [m for m in remote.list_entries(model=fp.model, limit=50)
                      if m.fingerprint.namespace == fp.namespace]
        if not candidates:
            result.outcome, result.reason = "miss", f"no entry for model {fp.model!r} yet"
            return None
        compatible = [m for m in candidates
                      if m.fingerprint.env == fp.env and m.fingerprint.hw == fp.hw]
        if self.config.fallback and compatible:
            nearest = compatible[0]
            result.differing = differing(nearest.fingerprint, fp)
            result.outcome = "fallback"
            result.reason = (f"exact key missed; using the newest entry of {fp.model!r} "
                             f"with the same env and hw (differs in "
                             f"{', '.join(result.differing)})")
            # the listing only nominates: what is loaded is fetched (and verified) by key and
            # must still be of this namespace and model, with the same env and hw
            got = remote.get_entry(nearest.key)
            if got is not None:
                _require_match(got[0], fp, ("namespace", "model", "env", "hw"))
            return got
        result.differing = differing(candidates[0].fingerprint, fp)
        result.outcome = "miss"
        result.reason = (f"no entry for this fingerprint; the newest entry of {fp.model!r} "
                         f"differs in {describe(candidates[0].fingerprint, fp)}")
        return None

    # -- step 2b: what the prefetch thread already fetched ------------------------------
    def _await_prefetch(self, result: LoadResult) -> PrefetchResult | None:
        """Wait (bounded) for a prefetch still running; None when there is none or it failed."""
        if self.prefetcher is None:
            return None
        done = self.prefetcher.wait(self.config.prefetch_wait_s)
        if done is None:
            self._warn(f"prefetch still running after {self.config.prefetch_wait_s:.0f}s; "
                       "fetching without it")
            return None
        result.bytes_down += done.bytes_down
        return None if done.error else done

    def _prefetch_failure(self, exc: Exception) -> str:
        """The prefetch's own error, when it is why the load found the server marked down."""
        done = self.prefetcher.wait(0) if self.prefetcher is not None else None
        if isinstance(exc, CircuitOpenError) and done is not None and done.error:
            return f" (the prefetch: {done.error})"
        return ""

    # -- step 3: fetch each blob once per node, verified --------------------------------
    def _fetch_blobs(self, remote: RemoteCache, entry: Manifest, result: LoadResult,
                     prefetched: PrefetchResult | None = None) -> dict[str, Path]:
        paths: dict[str, Path] = {}
        ready = prefetched.paths if prefetched is not None else {}
        for blob in entry.blobs:
            skip = skip_reason(self.config, blob)
            if skip:
                result.skipped[blob.role] = skip
                continue
            if prefetched is not None and blob.digest == prefetched.toolchain:
                continue  # the prefetch thread is fetching and placing it (step 4)
            if blob.digest in ready and _has_size(ready[blob.digest], blob.size):
                paths[blob.role] = ready[blob.digest]  # verified by the prefetch thread
                continue
            path, downloaded = self.node.fetch(
                blob.digest, blob.size,
                functools.partial(remote.download_blob, blob.digest, blob.size))
            result.bytes_down += downloaded
            paths[blob.role] = path
        if "megacache" not in paths:
            raise PackError("entry has no megacache bundle blob")
        return paths

    def _record_kernel_keys(self) -> None:
        """Watch torch key its kernels, so they ship and place by path-free identity."""
        try:
            relocate.recorder().install()
        except Exception as exc:
            self._warn(f"kernels will only be reused at this torch path: "
                       f"{type(exc).__name__}: {exc}")

    # -- step 4: place compiled artifacts where torch looks for them -------------------
    def _place_artifacts(self, entry: Manifest, paths: dict[str, Path], result: LoadResult,
                         prefetched: PrefetchResult | None = None) -> None:
        done = prefetched.placed if prefetched is not None else {}
        for role in ("kernels", "toolchain"):
            blob = entry.blob(role)
            if role not in paths or blob is None:
                continue
            count = done.get(blob.digest)
            result.placed[role] = count if count is not None else \
                place(role, paths[role], self.config.max_raw_bytes)
        if result.placed.get("kernels"):  # the ISA probe's libraries are on disk now
            vec_isa.probe_in_background()

    # -- step 6: the headers the prefetch thread places last ----------------------------
    def _await_toolchain(self, entry: Manifest | None, result: LoadResult,
                         prefetched: PrefetchResult | None = None) -> None:
        """Make torch wait (bounded) for the toolchain pack the prefetch thread places after
        the rest, when this entry names it. Even an exact hit needs it: Inductor precompiles
        its header before it loads any C++ kernel, a cached one too, and without the pack's
        `.gch` that is a g++ build of seconds (seen: 6 s on the MLP's first step). torch
        waits at the header itself (`KeyRecorder.hold_headers`), after loading the graphs
        and its preprocessor pass, so the unpacking overlaps those; where the recorder is
        not in torch, the load waits here."""
        toolchain = entry.blob("toolchain") if entry is not None else None
        if toolchain is None or prefetched is None or toolchain.digest != prefetched.toolchain:
            return
        deadline = time.monotonic() + self.config.prefetch_wait_s

        def wait_for_headers() -> None:
            started = time.monotonic()
            self._count_toolchain(result, max(0.0, deadline - started))
            result.steps.setdefault("toolchain", round(time.monotonic() - started, 4))

        if not relocate.recorder().hold_headers(wait_for_headers):
            wait_for_headers()

    def _count_toolchain(self, result: LoadResult, timeout: float) -> None:
        """The prefetch's toolchain pack, once in place, counted in `result`."""
        if self.prefetcher is None or not self.prefetcher.wait_toolchain(timeout):
            return
        done = self.prefetcher.result
        if done.toolchain is not None and done.toolchain in done.placed and \
                "toolchain" not in result.placed:
            result.placed["toolchain"] = done.placed[done.toolchain]
            result.bytes_down += done.toolchain_bytes

    # -- step 5: verify and hot-load the Mega-Cache bundle ------------------------------
    def _load_bundle(self, entry: Manifest, paths: dict[str, Path], result: LoadResult,
                     prefetched: PrefetchResult | None = None) -> None:
        ref = entry.blob("megacache")
        assert ref is not None
        ready = prefetched.bundles.pop(ref.digest, None) if prefetched is not None else None
        raw = ready if ready is not None else \
            read_bundle(ref, paths["megacache"], self.config.max_raw_bytes)
        artifacts = torch_env.read_artifacts(raw)
        if artifacts is None:
            raise PackError("torch refused the bundle (load_cache_artifacts returned None)")
        artifacts, result.precompile = precompile.for_loading(artifacts, result.outcome, ref)
        keys = torch_env.populate(artifacts)
        if keys.get(precompile.ARTIFACT_TYPE):
            precompile.reserve_ids(ref)
        if result.precompile:
            log.info("megacache: %s", result.precompile)
        result.loaded_keys = {(kind, k) for kind, ks in keys.items() for k in ks}

    # -- step 6: publish what this run compiled ----------------------------------------
    def publish(self, wait: bool = False) -> PublishResult:
        """Snapshot this run's artifacts now; upload them in a background thread.

        Uploads only when this run has something a track's loaded entry lacked, only from
        local rank 0, and never overwrites a newer entry (conditional PUT).
        """
        with self._lock:
            if self._publisher is None and self._may_publish():
                snapshot = self._snapshot()
                if snapshot is not None:
                    self._publisher = threading.Thread(target=self._upload, args=(snapshot,),
                                                       name="megacache-publish", daemon=True)
                    self._publisher.start()
        return self._join(wait)

    def _may_publish(self) -> bool:
        why = ""
        if not self.config.may_publish or not self.tracks:
            why = "publishing disabled or nothing compiled through megacache"
        elif os.environ.get("LOCAL_RANK", "0") != "0":
            why = "only local rank 0 publishes"
        for track in self.tracks.values() if why else ():
            track.publish.reason = why
        self._no_track.publish.reason = why or self._no_track.publish.reason
        return not why

    def _snapshot(self) -> Snapshot | None:
        """Save the Mega-Cache and list compiled files on the caller's thread (fast).

        Kernels compare by path-free identity: a consumer whose torch is elsewhere holds the
        entry's kernels under other names, and must not publish them back as new (thrash).
        """
        try:
            saved = torch_env.save_bundle()
            if saved is None:
                for track in self.tracks.values():
                    track.publish.reason = "torch recorded no cache artifacts"
                return None
            artifacts = torch_env.read_artifacts(saved[0])
            if artifacts is None:
                raise ValueError("torch could not read its own Mega-Cache bytes")
            artifacts, self.precompile_shared = precompile.for_shipping(
                artifacts, self._precompile_keys)
            keys = torch_env.keys_of(artifacts)
            kernels = _files(torch_env.inductor_cache_dir(), KERNEL_SUFFIXES,
                             exclude=("triton", "locks"))
            ids = relocate.recorder().ids_for(kernels)
            kernels = relocate.dedupe(kernels, ids)
            new_keys = {(kind, k) for kind, ks in keys.items() for k in ks}
            tracks = [t for t in self.tracks.values()
                      if self._lacks(t, new_keys, relocate.content_ids(kernels, ids))]
            if not tracks:
                return None
            artifacts = torch_env.merged(self._loaded_artifacts(), artifacts)
            counts = {kind: len(ks) for kind, ks in torch_env.keys_of(artifacts).items()}
            return Snapshot(torch_env.to_bytes(artifacts), counts, kernels,
                            torch_env.compile_seconds(), tracks)
        except Exception as exc:
            self._warn(f"could not snapshot cache artifacts: {type(exc).__name__}: {exc}")
            for track in self.tracks.values():
                track.publish.reason = "snapshot failed"
            return None

    def _loaded_artifacts(self) -> torch_env.Artifacts:
        """What this process loaded from exact hits, read again from the node cache.

        torch's save holds only what this process recorded, and a graph served by a
        precompiled Dynamo entry is never looked up in the FX-graph or AOTAutograd caches, so
        a republish built from the save alone would drop every graph the run loaded but did
        not compile. Fallback entries are left out: they are another code version's.
        """
        out: torch_env.Artifacts = {}
        seen: set[str] = set()
        for track in self.tracks.values():
            load = track.load
            ref = load.entry.blob("megacache") if load.entry is not None else None
            if load.outcome != "hit" or ref is None or ref.digest in seen:
                continue
            seen.add(ref.digest)
            path = self.node.path(ref.digest)
            if not NodeCache.verified(path, ref.digest, ref.size):
                continue
            artifacts = torch_env.read_artifacts(
                read_bundle(ref, path, self.config.max_raw_bytes)) or {}
            loaded = self._loaded_with(ref)
            out = torch_env.merged(out, {
                kind: [a for a in items if (kind, a.key) in loaded]
                for kind, items in artifacts.items()})
        return out

    def _lacks(self, track: Track, new_keys: set[tuple[str, str]], kernel_ids: set[str]
               ) -> bool:
        """Whether this track's entry should be (re)written with this run's artifacts."""
        load, res = track.load, track.publish
        if load.outcome in ("invalid", "error"):
            res.reason = f"not publishing after a failed load ({load.outcome})"
            return False
        if load.outcome == "hit" and load.entry is not None \
                and new_keys <= self._loaded_with(load.entry.blob("megacache")) \
                and kernel_ids <= self._entry_pack_ids(load.entry, "kernels"):
            res.reason = "the loaded entry already has everything this run compiled"
            return False
        return True

    def _loaded_with(self, bundle: BlobRef | None) -> set[tuple[str, str]]:
        """What every track that loaded this bundle got from it: torch keeps one
        Mega-Cache per process, so the tracks of one process share what they loaded."""
        keys: set[tuple[str, str]] = set()
        for t in self.tracks.values():
            other = t.load.entry.blob("megacache") if t.load.entry is not None else None
            if other is not None and bundle is not None and other.digest == bundle.digest:
                keys |= t.load.loaded_keys
        return keys

    def _entry_pack_ids(self, entry: Manifest, role: str) -> set[str]:
        """What the entry's pack holds (relocate.content_ids), read from the node cache."""
        blob = entry.blob(role)
        if blob is None:
            return set()
        path = self.node.path(blob.digest)
        if not NodeCache.verified(path, blob.digest, blob.size):
            return set()
        try:
            names = pack_names(path, self.config.max_raw_bytes)
            return relocate.content_ids(names, relocate.parse_index(read_index(path)))
        except PackError:
            return set()

    def _upload(self, snap: Snapshot) -> None:
        """Upload the blobs once, then write each track's entry (its own key, its own etag)."""
        try:
            with RemoteCache(self.config) as remote:
                blobs = [self.bundle_blob(snap.raw, precompile.producer_meta(snap.counts))]
                if self.config.ship_kernels and snap.kernels:
                    blobs.append(self._pack_blob(
                        "kernels", snap.kernels, relocate.recorder().ids_for(snap.kernels)))
                if self.config.ship_toolchain:
                    toolchain = self._toolchain_blob(remote)
                    if toolchain is not None:
                        blobs.append(toolchain)
                snap.tracks[0].publish.bytes_up += upload_blobs(remote, self.node, blobs)
                for track in snap.tracks:
                    self._put_entry(remote, track, blobs, snap)
        except Exception as exc:
            for track in snap.tracks:
                track.publish.reason = f"publish failed: {type(exc).__name__}: {exc}"
            self._warn(snap.tracks[0].publish.reason)

    def _put_entry(self, remote: RemoteCache, track: Track, blobs: list[BlobRef],
                   snap: Snapshot) -> None:
        res, load = track.publish, track.load
        manifest = build_manifest(track.fp, blobs, snap.counts, snap.compile_s, load.entry)
        same_key = load.outcome == "hit" and load.etag
        etag = remote.put_entry(manifest, if_match=load.etag if same_key else None,
                                if_none_match=None if same_key else "*")
        res.key = manifest.key
        if etag is None:
            res.reason = "another producer published this key first"
        else:
            res.published, res.reason = True, f"published {len(blobs)} blob(s)"
            log.info("megacache: published %s for %s (%d bytes uploaded)", manifest.key[:12],
                     track.fp.model, res.bytes_up)

    def bundle_blob(self, raw: bytes, meta: dict[str, str] | None = None) -> BlobRef:
        data = compress_bytes(raw)
        digest = sha256_hex(data)
        tmp = self.node.blob_dir / f".{uuid.uuid4().hex}.new"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        self.node.add(digest, tmp)
        return BlobRef(digest=digest, size=len(data), role="megacache", compression="zstd",
                       raw_size=len(raw), raw_sha256=sha256_hex(raw), meta=meta or {})

    def _pack_blob(self, role: str, files: dict[str, Path], ids: dict[str, str],
                   contents: str | None = None) -> BlobRef:
        """A pack of compiled files with its identity index; its meta says what build made
        it (the consumer's check), never where torch was installed."""
        tmp = self.node.blob_dir / f".{uuid.uuid4().hex}.new"
        raw_size, size = write_pack(files.items(), tmp, index=relocate.index_bytes(ids))
        digest = sha256_file(tmp)
        self.node.add(digest, tmp)
        meta = {**relocate.build_meta(), "files": str(len(files))}
        if contents is not None:
            meta["contents"] = contents
        return BlobRef(digest=digest, size=size, role=role, compression="zstd",
                       raw_size=raw_size, meta=meta)

    def _toolchain_blob(self, remote: RemoteCache) -> BlobRef | None:
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
        loaded = [self.load_result.entry] if self.load_result.entry is not None else []
        assert self.fp is not None
        try:
            stored = remote.list_entries(env=self.fp.env, hw=self.fp.hw, limit=20)
        except Exception:
            stored = []
        for entry in loaded + stored:
            blob = entry.blob("toolchain")
            if blob is not None and blob.meta.get("contents") == contents \
                    and not relocate.refusal(blob.meta):
                return blob
        return self._pack_blob("toolchain", files, ids, contents=contents)

    def _join(self, wait: bool) -> PublishResult:
        if wait and self._publisher is not None:
            self._publisher.join(self.config.publish_wait_s)
            if self._publisher.is_alive():
                self._warn(f"publish still running after {self.config.publish_wait_s:.0f}s; "
                           "leaving it")
        return self.publish_result

    # -- step 7: report -----------------------------------------------------------------
    def events(self) -> list[Event]:
        """One event per track. The process-wide figures (compile seconds, seconds saved,
        bytes) go on the first track's event only, so stats never count them twice."""
        counters = torch_env.cache_counters() if self.tracks else {}
        compile_s = torch_env.compile_seconds() if self.tracks else 0.0
        out = []
        for n, track in enumerate(self.tracks.values()):
            event = self._event(track, counters, compile_s if n == 0 else None)
            if event is not None:
                out.append(event)
        return out

    def event(self) -> Event | None:
        events = self.events()
        return events[0] if events else None

    def _event(self, track: Track, counters: dict[str, int],
               compile_s: float | None) -> Event | None:
        res = track.load
        if res.key is None or res.outcome is None:
            return None
        outcome = res.outcome
        if outcome in ("hit", "fallback") and counters["fxgraph_miss"] > 0 \
                and counters["fxgraph_hit"] + counters["aot_hit"] == 0 \
                and precompile.counters()["served"] == 0:
            outcome = "inert"
            res.reason = ("bundle loaded but torch found none of its graphs (FX graph, "
                          "AOTAutograd and precompiled Dynamo cache hits = 0)")
            self._warn(res.reason)
        cold = res.entry.cold_compile_s if res.entry is not None else None
        saved = 0.0
        if compile_s is not None and cold is not None and outcome != "inert":
            saved = max(0.0, cold - compile_s)
        first = compile_s is not None
        return Event(
            key=res.key, model=track.fp.model, outcome=outcome, reason=res.reason[:2000],
            entry_key=res.entry.key if res.entry else None, differing=res.differing,
            compile_s=round(compile_s or 0.0, 3), cold_compile_s=cold, saved_s=round(saved, 3),
            load_s=round(res.seconds, 3), bytes_down=res.bytes_down,
            bytes_up=track.publish.bytes_up, fxgraph_hit=counters["fxgraph_hit"] if first else 0,
            fxgraph_miss=counters["fxgraph_miss"] if first else 0,
            published=track.publish.published,
            **(self._start_fields() if first else {}),
        )

    def _start_fields(self) -> dict[str, Any]:
        """The event's time-to-start split and precompile fields (issue 13)."""
        return {**self._precompile_fields(), **self.clock.fields()}

    def _precompile_fields(self) -> dict[str, Any]:
        """The event's precompile counters (torch's) and why it was not used, if it was not."""
        c = precompile.counters()
        note = self.precompile_off or self.precompile_shared or self.load_result.precompile
        return {"precompile_hit": c["hit"], "precompile_miss": c["miss"] + c["error"],
                "precompile_reason": note[:500]}

    def report(self) -> Event | None:
        """POST this run's events (within the load deadline); returns the first one."""
        try:
            events = self.events()
            if not events:
                return None
            with RemoteCache(self.config, deadline=Deadline(self.config.load_deadline_s)) \
                    as remote:
                for event in events:
                    remote.post_event(event.to_dict())
            return events[0]
        except Exception as exc:
            log.debug("megacache: could not report the run's events: %s", exc)
            return self.event() if self.tracks else None

    def retire(self) -> None:
        """Stop without publishing or reporting: another session took this one's place."""
        with self._lock:
            self._closed = True

    def close(self) -> Event | None:
        """Publish (bounded wait), report, and stop. Safe to call more than once."""
        with self._lock:
            if self._closed or not self.config.enabled:
                return None
            self._closed = True
        self.publish(wait=True)
        self._forget_precompiled()
        if self.tracks and self._first.load.entry is not None:
            self._count_toolchain(self._first.load, self.config.prefetch_wait_s)
        return self.report()

    def _forget_precompiled(self) -> None:
        """Leave no precompiled entry on local disk for another process to load ungated."""
        if self.precompile_off or not precompile.enabled():
            return
        try:
            precompile.forget_local(k for kind, k in self.load_result.loaded_keys
                                    if kind == precompile.ARTIFACT_TYPE)
        except Exception as exc:
            log.debug("megacache: could not clear local precompiled entries: %s", exc)

    # -- failure policy -----------------------------------------------------------------
    def _fail(self, result: LoadResult, outcome: Outcome, reason: str) -> None:
        result.outcome, result.reason = outcome, reason
        result.entry = None
        self._warn(f"{outcome}: {reason}; compiling cold")
        if self.config.mode == "required":
            raise MegacacheError(f"megacache {outcome}: {reason}")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("megacache: %s", message)
        else:
            log.info("megacache: %s", message)


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


def _require_match(entry: Manifest, fp: Fingerprint, components: tuple[str, ...]) -> None:
    """Refuse an entry whose fingerprint differs from ours in `components`."""
    names = [name for name in ("namespace", *components)
             if getattr(entry.fingerprint, name) != getattr(fp, name)]
    if names:
        raise UntrustedEntryError(f"entry {entry.key[:12]}… differs from this job in "
                                  f"{', '.join(dict.fromkeys(names))}: refusing it")


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


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
