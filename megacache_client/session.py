"""The client lifecycle inside a trainer: fingerprint → fetch → verify → load → publish → report.

Each step is a method of `Session`. The rule over all of them: nothing the cache does may
hurt the trainer. Any failure is caught, logged as one clear warning, and the run compiles
cold; only `mode="required"` turns a failure into an exception.
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

from megacache_client import __version__, precompile, torch_env, tts
from megacache_client.config import ClientConfig
from megacache_client.events import Event, Outcome
from megacache_client.manifest import BlobRef, Fingerprint, Manifest, sha256_hex
from megacache_client.nodecache import NodeCache
from megacache_client.packs import (
    PackError,
    compress_bytes,
    decompress_bytes,
    pack_names,
    write_pack,
)
from megacache_client.prefetch import (
    KERNEL_SUFFIXES,
    TOOLCHAIN_SUFFIXES,
    Prefetcher,
    PrefetchResult,
    place,
    skip_reason,
)
from megacache_client.transport import CorruptBlobError, Progress, RemoteCache, sha256_file

log = logging.getLogger("megacache")

COMPONENTS = ("namespace", "model", "code", "env", "hw", "config")


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


class Session:
    """One process's use of the cache for one fingerprint."""

    def __init__(self, config: ClientConfig, *, model: str | None = None,
                 code: str | None = None, compile_options: dict[str, Any] | None = None,
                 fingerprint: Fingerprint | None = None) -> None:
        self.config = config
        self.model = model or config.model
        self.code = code or config.code
        self.compile_options = compile_options
        self.fp: Fingerprint | None = fingerprint
        self.load_result = LoadResult()
        self.publish_result = PublishResult()
        self.node = NodeCache(config.node_cache_dir, config.lock_timeout_s)
        self._loaded = False
        self._closed = False
        self._warned = False
        self._publisher: threading.Thread | None = None
        self._lock = threading.RLock()
        self.clock = tts.TimeToStart()
        self.prefetcher: Prefetcher | None = None
        self.precompile_off = ""
        """Why caching precompile is off in this process ("" when on)."""

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

    # -- entry points -------------------------------------------------------------------
    def before_compile(self, module: Any, options: dict[str, Any]) -> None:
        """Called by the torch.compile hook: load once, before the first compilation."""
        self.load(module, options)

    def after_compile(self, compiled: Any) -> Any:
        """Called by the torch.compile hook with its result: time the first compiled step."""
        if not self.config.enabled or self.clock.first_step_end is not None:
            return compiled
        return tts.watch(compiled, self.clock)

    def load(self, module: Any = None, options: dict[str, Any] | None = None) -> LoadResult:
        with self._lock:
            if self._loaded or not self.config.enabled:
                return self.load_result
            self._loaded = True
            started = time.monotonic()
            result = self.load_result
            try:
                step = result.timer()
                fp = self.fingerprint(module, options)
                result.key = fp.key()
                torch_env.set_job_id("megacache-" + result.key[:16])
                step("fingerprint")
                prefetched = self._await_prefetch(result)
                step("prefetch")
                if self.prefetcher is not None:  # its compiler imports: "rest" in the split
                    self.prefetcher.wait_imports(self.config.prefetch_wait_s)
                    step("imports")
                with RemoteCache(self.config) as remote:
                    found = self._find_entry(remote, fp, result)
                    step("find")
                    if found is not None:
                        result.entry, result.etag = found
                        paths = self._fetch_blobs(remote, result.entry, result, prefetched)
                        step("fetch")
                        self._place_artifacts(result.entry, paths, result, prefetched)
                        step("place")
                        self._load_bundle(result.entry, paths, result)
                        step("load")
            except (CorruptBlobError, PackError) as exc:
                self._fail(result, "invalid", str(exc))
            except Exception as exc:  # never let the cache break the trainer
                self._fail(result, "error", f"{type(exc).__name__}: {exc}")
            finally:
                result.seconds = time.monotonic() - started
                steps = result.steps
                self.clock.fetch_s = sum(steps.get(k, 0.0) for k in ("prefetch", "find", "fetch"))
                self.clock.load_s = sum(steps.get(k, 0.0)
                                        for k in ("fingerprint", "place", "load"))
            if result.outcome in ("hit", "fallback"):
                log.info("megacache: %s %s in %.2fs (%s)", result.outcome,
                         (result.entry.key[:12] if result.entry else ""), result.seconds,
                         result.reason)
            return result

    # -- step 1: fingerprint ------------------------------------------------------------
    def fingerprint(self, module: Any = None, options: dict[str, Any] | None = None
                    ) -> Fingerprint:
        """The key's components. Computed once; the first compiled module names the model."""
        if self.fp is None:
            options = options if options is not None else self.compile_options
            self.fp = Fingerprint(
                namespace=self.config.namespace,
                model=self.model or (torch_env.model_name(module) if module is not None
                                     else "default"),
                code=self.code or (torch_env.code_digest(module) if module is not None
                                   else "unknown"),
                env=torch_env.env_component(),
                hw=torch_env.hw_component(),
                config=torch_env.config_component(options),
            )
        return self.fp

    # -- step 2: find the entry (exact, else the nearest of the same model) -------------
    def _find_entry(self, remote: RemoteCache, fp: Fingerprint,
                    result: LoadResult) -> tuple[Manifest, str] | None:
        exact = remote.get_entry(fp.key())
        if exact is not None:
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
            result.differing = _differing(nearest.fingerprint, fp)
            result.outcome = "fallback"
            result.reason = (f"exact key missed; using the newest entry of {fp.model!r} "
                             f"with the same env and hw (differs in "
                             f"{', '.join(result.differing)})")
            got = remote.get_entry(nearest.key)
            return got if got is not None else None
        result.differing = _differing(candidates[0].fingerprint, fp)
        result.outcome = "miss"
        result.reason = (f"no entry for this fingerprint; the newest entry of {fp.model!r} "
                         f"differs in {_describe(candidates[0].fingerprint, fp)}")
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

    # -- step 5: verify and hot-load the Mega-Cache bundle ------------------------------
    def _load_bundle(self, entry: Manifest, paths: dict[str, Path], result: LoadResult) -> None:
        ref = entry.blob("megacache")
        assert ref is not None
        data = paths["megacache"].read_bytes()
        if ref.compression == "zstd":
            if ref.raw_size is None:
                raise PackError("compressed bundle without raw_size")
            raw = decompress_bytes(data, ref.raw_size, ref.raw_sha256, self.config.max_raw_bytes)
        else:
            raw = data
        refused = precompile.refusal(result.outcome, ref)
        loaded = torch_env.load_bundle(
            raw, skip=frozenset({precompile.ARTIFACT_TYPE}) if refused else frozenset())
        if loaded is None:
            raise PackError("torch refused the bundle (load_cache_artifacts returned None)")
        keys, skipped = loaded
        if keys.get(precompile.ARTIFACT_TYPE):
            precompile.reserve_ids(ref)
        if skipped:
            result.precompile = f"precompiled Dynamo output not loaded: {refused}"
            log.info("megacache: %s", result.precompile)
        result.loaded_keys = {(kind, k) for kind, ks in keys.items() for k in ks}

    # -- step 6: publish what this run compiled ----------------------------------------
    def publish(self, wait: bool = False) -> PublishResult:
        """Snapshot this run's artifacts now; upload them in a background thread.

        Uploads only when this run has something the loaded entry lacked, only from local
        rank 0, and never overwrites a newer entry (conditional PUT).
        """
        with self._lock:
            if self._publisher is not None or not self._may_publish():
                return self._join(wait)
            snapshot = self._snapshot()
            if snapshot is None:
                return self._join(wait)
            self._publisher = threading.Thread(target=self._upload, args=snapshot,
                                               name="megacache-publish", daemon=True)
            self._publisher.start()
        return self._join(wait)

    def _may_publish(self) -> bool:
        res = self.publish_result
        if not self.config.may_publish or self.fp is None or not self._loaded:
            res.reason = "publishing disabled or nothing compiled through megacache"
            return False
        if self.load_result.outcome in ("invalid", "error"):
            res.reason = f"not publishing after a failed load ({self.load_result.outcome})"
            return False
        if os.environ.get("LOCAL_RANK", "0") != "0":
            res.reason = "only local rank 0 publishes"
            return False
        return True

    def _snapshot(self) -> tuple[bytes, dict[str, int], dict[str, Path], float] | None:
        """Save the Mega-Cache and list compiled files on the caller's thread (fast)."""
        res = self.publish_result
        try:
            saved = torch_env.save_bundle()
            if saved is None:
                res.reason = "torch recorded no cache artifacts"
                return None
            raw, keys = saved
            kernels = _files(torch_env.inductor_cache_dir(), KERNEL_SUFFIXES,
                             exclude=("triton", "locks"))
            new_keys = {(kind, k) for kind, ks in keys.items() for k in ks}
            entry = self.load_result.entry
            if self.load_result.outcome == "hit" and entry is not None:
                old_kernels = self._entry_pack_names(entry, "kernels")
                if new_keys <= self.load_result.loaded_keys and set(kernels) <= old_kernels:
                    res.reason = "the loaded entry already has everything this run compiled"
                    return None
            counts = {kind: len(ks) for kind, ks in keys.items()}
            return raw, counts, kernels, torch_env.compile_seconds()
        except Exception as exc:
            self._warn(f"could not snapshot cache artifacts: {type(exc).__name__}: {exc}")
            res.reason = "snapshot failed"
            return None

    def _entry_pack_names(self, entry: Manifest, role: str) -> set[str]:
        blob = entry.blob(role)
        if blob is None or not NodeCache.verified(self.node.path(blob.digest), blob.digest,
                                                   blob.size):
            return set()
        try:
            return set(pack_names(self.node.path(blob.digest), self.config.max_raw_bytes))
        except PackError:
            return set()

    def _upload(self, raw: bytes, counts: dict[str, int], kernels: dict[str, Path],
                compile_s: float) -> None:
        res = self.publish_result
        try:
            assert self.fp is not None
            with RemoteCache(self.config) as remote:
                blobs = [self.bundle_blob(raw, precompile.producer_meta(counts))]
                if self.config.ship_kernels and kernels:
                    blobs.append(self._pack_blob("kernels", kernels))
                if self.config.ship_toolchain:
                    toolchain = self._toolchain_blob(remote)
                    if toolchain is not None:
                        blobs.append(toolchain)
                manifest = self.manifest_for(blobs, counts, compile_s)
                res.bytes_up += upload_blobs(remote, self.node, blobs)
                same_key = self.load_result.outcome == "hit" and self.load_result.etag
                etag = remote.put_entry(
                    manifest,
                    if_match=self.load_result.etag if same_key else None,
                    if_none_match=None if same_key else "*",
                )
            res.key = manifest.key
            if etag is None:
                res.reason = "another producer published this key first"
            else:
                res.published, res.reason = True, f"published {len(blobs)} blob(s)"
                log.info("megacache: published %s (%d bytes uploaded)", manifest.key[:12],
                         res.bytes_up)
        except Exception as exc:
            res.reason = f"publish failed: {type(exc).__name__}: {exc}"
            self._warn(res.reason)

    def bundle_blob(self, raw: bytes, meta: dict[str, str] | None = None) -> BlobRef:
        data = compress_bytes(raw)
        digest = sha256_hex(data)
        tmp = self.node.blob_dir / f".{uuid.uuid4().hex}.new"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        self.node.add(digest, tmp)
        return BlobRef(digest=digest, size=len(data), role="megacache", compression="zstd",
                       raw_size=len(raw), raw_sha256=sha256_hex(raw), meta=meta or {})

    def _pack_blob(self, role: str, files: dict[str, Path], names: str | None = None
                   ) -> BlobRef:
        tmp = self.node.blob_dir / f".{uuid.uuid4().hex}.new"
        raw_size, size = write_pack(files.items(), tmp)
        digest = sha256_file(tmp)
        self.node.add(digest, tmp)
        meta = {"torch_prefix": torch_env.torch_prefix(), "files": str(len(files))}
        if names is not None:
            meta["names"] = names
        return BlobRef(digest=digest, size=size, role=role, compression="zstd",
                       raw_size=raw_size, meta=meta)

    def _toolchain_blob(self, remote: RemoteCache) -> BlobRef | None:
        """The precompiled header pack, reusing one already stored when it holds our files.

        The header is model-independent but g++ does not write it byte-identically twice, so
        content addressing alone would store a new ~21 MB copy per cold producer. Its file
        names are content keys (of header text + flags), recorded in the blob's meta: a
        stored pack with the same names and torch path is the same toolchain.
        """
        files = _files(torch_env.header_dir(), TOOLCHAIN_SUFFIXES, exclude=("locks",))
        if not files:
            return None
        names = ",".join(sorted(files))
        prefix = torch_env.torch_prefix()
        loaded = [self.load_result.entry] if self.load_result.entry is not None else []
        assert self.fp is not None
        try:
            stored = remote.list_entries(env=self.fp.env, hw=self.fp.hw, limit=20)
        except Exception:
            stored = []
        for entry in loaded + stored:
            blob = entry.blob("toolchain")
            if blob is not None and blob.meta.get("names") == names \
                    and blob.meta.get("torch_prefix") == prefix:
                return blob
        return self._pack_blob("toolchain", files, names=names)

    def manifest_for(self, blobs: list[BlobRef], counts: dict[str, int],
                  compile_s: float) -> Manifest:
        """cold_compile_s stays the cold time: a partly warm run only raises it, never lowers."""
        assert self.fp is not None
        loaded = self.load_result.entry
        cold = compile_s if loaded is None else max(compile_s, loaded.cold_compile_s)
        return Manifest(
            key=self.fp.key(), blobs=blobs, fingerprint=self.fp,
            torch_version=torch_env.torch_version(), triton_version=torch_env.triton_version(),
            artifact_counts=counts, cold_compile_s=round(cold, 3),
            created_at=datetime.now(timezone.utc),
            producer={"client": f"megacache {__version__}",
                      "rank": os.environ.get("RANK", "0")},
        )

    def _join(self, wait: bool) -> PublishResult:
        if wait and self._publisher is not None:
            self._publisher.join(self.config.publish_wait_s)
            if self._publisher.is_alive():
                self._warn(f"publish still running after {self.config.publish_wait_s:.0f}s; "
                           "leaving it")
        return self.publish_result

    # -- step 7: report -----------------------------------------------------------------
    def event(self) -> Event | None:
        res = self.load_result
        if res.key is None or res.outcome is None or self.fp is None:
            return None
        counters = torch_env.cache_counters()
        outcome = res.outcome
        if outcome in ("hit", "fallback") and counters["fxgraph_hit"] == 0 \
                and counters["fxgraph_miss"] > 0:
            outcome = "inert"
            res.reason = "bundle loaded but torch found none of its graphs (fxgraph hits = 0)"
            self._warn(res.reason)
        compile_s = torch_env.compile_seconds()
        cold = res.entry.cold_compile_s if res.entry is not None else None
        saved = max(0.0, cold - compile_s) if cold is not None and outcome != "inert" else 0.0
        return Event(
            key=res.key, model=self.fp.model, outcome=outcome, reason=res.reason[:2000],
            entry_key=res.entry.key if res.entry else None, differing=res.differing,
            compile_s=round(compile_s, 3), cold_compile_s=cold, saved_s=round(saved, 3),
            load_s=round(res.seconds, 3), bytes_down=res.bytes_down,
            bytes_up=self.publish_result.bytes_up, fxgraph_hit=counters["fxgraph_hit"],
            fxgraph_miss=counters["fxgraph_miss"], published=self.publish_result.published,
            **self._start_fields(),
        )

    def _start_fields(self) -> dict[str, Any]:
        """The event's time-to-start split and precompile fields (issue 13)."""
        return {**self._precompile_fields(), **self.clock.fields()}

    def _precompile_fields(self) -> dict[str, Any]:
        """The event's precompile counters (torch's) and why it was not used, if it was not."""
        c = precompile.counters()
        note = self.precompile_off or self.load_result.precompile
        return {"precompile_hit": c["hit"], "precompile_miss": c["miss"] + c["error"],
                "precompile_reason": note[:500]}

    def report(self) -> Event | None:
        """POST this run's event; returns it (also when the server could not take it)."""
        try:
            event = self.event()
            if event is None:
                return None
            with RemoteCache(self.config) as remote:
                remote.post_event(event.model_dump(mode="json"))
            return event
        except Exception as exc:
            log.debug("megacache: could not report the run's event: %s", exc)
            return None

    def close(self) -> Event | None:
        """Publish (bounded wait), report, and stop. Safe to call more than once."""
        with self._lock:
            if self._closed or not self.config.enabled:
                return None
            self._closed = True
        self.publish(wait=True)
        self._forget_precompiled()
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


def upload_blobs(remote: RemoteCache, node: NodeCache, blobs: list[BlobRef],
                 progress: Progress | None = None) -> int:
    """Upload the blobs the server lacks (HEAD before PUT); returns the bytes sent."""
    sent = 0
    for blob in blobs:
        if not remote.has_blob(blob.digest):
            remote.upload_blob(node.path(blob.digest), blob.digest, progress)
            sent += blob.size
    return sent


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _differing(a: Fingerprint, b: Fingerprint) -> list[str]:
    return [name for name in COMPONENTS if getattr(a, name) != getattr(b, name)]


def _describe(theirs: Fingerprint, ours: Fingerprint) -> str:
    parts = []
    for name in _differing(theirs, ours):
        t, o = getattr(theirs, name), getattr(ours, name)
        if isinstance(t, dict) and isinstance(o, dict):
            keys = sorted(k for k in set(t) | set(o) if t.get(k) != o.get(k))
            detail = ", ".join(f"{k}: {t.get(k)!r} vs {o.get(k)!r}" for k in keys[:4])
            parts.append(f"{name} ({detail})")
        else:
            parts.append(f"{name} ({t!r} vs {o!r})")
    return "; ".join(parts) or "nothing (listing raced a write)"


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
