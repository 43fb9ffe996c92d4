"""The load side of a session: find the entry, fetch its blobs, place them, load the bundle.

A compile asks for one fingerprint; this module turns the answer of the server (and of the
prefetch thread, which may have fetched and placed most of it already) into torch's caches.
Every function here raises on trouble: the session decides what a failure costs (one
warning and a cold compile, or an exception in `required` mode).

The placing helpers (`place`, `read_bundle`, `skip_reason`) are shared with the prefetch
thread, so a blob fetched early and one fetched by the load are checked and unpacked alike.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from filelock import FileLock, Timeout

from megacache_client import precompile, relocate, torch_env, vec_isa
from megacache_client.config import ClientConfig
from megacache_client.errors import blamed_on
from megacache_client.fingerprint import COMPONENTS, describe, differing
from megacache_client.job import RESOLUTION_TTL_S, JobIdentity
from megacache_client.manifest import BlobRef, Fingerprint, Manifest, component_digest
from megacache_client.nodecache import NodeCache
from megacache_client.packs import PackError, decompress_bytes, read_index, safe_name, unpack
from megacache_client.results import LoadResult
from megacache_client.transport import (
    CircuitOpenError,
    RemoteCache,
    ResolutionUnsupported,
    UntrustedEntryError,
    UntrustedWriterError,
)

if TYPE_CHECKING:  # the prefetcher places with this module's helpers
    from megacache_client.prefetch import Prefetcher, PrefetchResult

log = logging.getLogger("megacache")

KERNEL_SUFFIXES = (".so",)
TOOLCHAIN_SUFFIXES = (".h", ".gch")
T = TypeVar("T")


# -- what the prefetch thread already fetched ----------------------------------------------
def await_prefetch(prefetcher: Prefetcher | None, wait_s: float, result: LoadResult,
                   warn: Callable[[str], None]) -> PrefetchResult | None:
    """Wait (bounded) for a prefetch still running; None when there is none or it failed."""
    if prefetcher is None:
        return None
    done = prefetcher.wait(wait_s)
    if done is None:
        warn(f"prefetch still running after {wait_s:.0f}s; fetching without it")
        return None
    result.bytes_down += done.bytes_down
    return None if done.error else done


def failure_reason(prefetcher: Prefetcher | None, exc: Exception) -> str:
    """Why the load failed, the root cause first: when it found the server marked down
    because this process's own prefetch (or the earlier one it continued) gave up on it,
    that prefetch's error is the reason, not the breaker it opened."""
    reason = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, CircuitOpenError):
        return reason
    errors = []
    while prefetcher is not None:
        done = prefetcher.wait(0)
        if done is not None and done.error:
            errors.append(done.error)
        prefetcher = prefetcher.previous
    root = next((e for e in errors if not e.startswith(CircuitOpenError.__name__)), None)
    if root is not None:
        return f"{root} (the prefetch; then {reason})"
    return f"{reason} (the prefetch: {errors[0]})" if errors else reason


def watch_kernel_keys() -> str:
    """Watch torch key its kernels, so they ship and place by path-free identity; returns
    what that costs when it cannot ("" when it can)."""
    try:
        relocate.recorder().install()
    except Exception as exc:
        return f"kernels will only be reused at this torch path: {type(exc).__name__}: {exc}"
    return ""


# -- find the entry (exact, else the nearest of the same model) ----------------------------
def find_entry(remote: RemoteCache, fp: Fingerprint, result: LoadResult, fallback: bool,
               prefetched: PrefetchResult | None = None, job: JobIdentity | None = None
               ) -> tuple[Manifest, str] | None:
    """The entry (and its etag) to load for `fp`; `result` says which and why.

    A process of a job asks the server for the job attempt's resolution: every rank gets
    the answer the first one got, whatever is published meanwhile (a rank that hits while
    another compiles holds the whole job at its first collective). A server too old to
    resolve leaves each process to decide alone, as before.
    """
    try:
        return _find_entry(remote, fp, result, fallback, prefetched, job)
    except UntrustedWriterError as exc:
        result.outcome, result.reason = "miss", f"untrusted writer: {exc}"
        if exc.key == fp.key():
            result.untrusted_etag = exc.etag
        return None


def _find_entry(remote: RemoteCache, fp: Fingerprint, result: LoadResult, fallback: bool,
                prefetched: PrefetchResult | None, job: JobIdentity | None
                ) -> tuple[Manifest, str] | None:
    if job is not None and job.job_id is not None:
        try:
            return _resolve_for_job(remote, fp, result, fallback, job)
        except ResolutionUnsupported as exc:
            result.job_note = str(exc)
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
    if fallback and compatible:
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


def _resolve_for_job(remote: RemoteCache, fp: Fingerprint, result: LoadResult,
                     fallback: bool, job: JobIdentity) -> tuple[Manifest, str] | None:
    assert job.job_id is not None
    rule = {"namespace": fp.namespace, "model": fp.model, "env": component_digest(fp.env),
            "hw": component_digest(fp.hw)} if fallback else None
    got = remote.resolve_entry(fp.key(), job=job.job_id, attempt=job.attempt,
                               ttl_s=RESOLUTION_TTL_S, fallback=rule)
    whose = f"job {job.job_id} attempt {job.attempt}"
    if got is None:
        result.outcome = "miss"
        result.reason = f"no entry for this fingerprint when {whose} first looked"
        return None
    if got[0].key == fp.key():
        _require_match(got[0], fp, COMPONENTS)
        result.outcome, result.reason = "hit", f"exact fingerprint ({whose})"
        return got
    _require_match(got[0], fp, ("namespace", "model", "env", "hw"))
    result.differing = differing(got[0].fingerprint, fp)
    result.outcome = "fallback"
    result.reason = (f"exact key missed; using the newest entry of {fp.model!r} with the "
                     f"same env and hw when {whose} first looked (differs in "
                     f"{', '.join(result.differing)})")
    return got


# -- fetch each blob once per node, verified ----------------------------------------------
def fetch_blobs(remote: RemoteCache, config: ClientConfig, node: NodeCache, entry: Manifest,
                result: LoadResult, prefetched: PrefetchResult | None = None
                ) -> dict[str, Path]:
    """role -> verified local path of each blob of `entry` that can help here."""
    paths: dict[str, Path] = {}
    ready = prefetched.paths if prefetched is not None else {}
    for blob in entry.blobs:
        skip = skip_reason(config, blob)
        if skip:
            result.skipped[blob.role] = skip
            continue
        if prefetched is not None and blob.digest == prefetched.toolchain:
            continue  # the prefetch thread is fetching and placing it (await_toolchain)
        if blob.digest in ready and _has_size(ready[blob.digest], blob.size):
            paths[blob.role] = ready[blob.digest]  # verified by the prefetch thread
            continue
        path, downloaded = node.fetch(
            blob.digest, blob.size,
            functools.partial(remote.download_blob, blob.digest, blob.size))
        result.bytes_down += downloaded
        paths[blob.role] = path
    if "megacache" not in paths:
        raise PackError("entry has no megacache bundle blob")
    return paths


def skip_reason(config: ClientConfig, blob: BlobRef) -> str:
    """Why a compiled-artifact blob cannot help here (it would only cost a download)."""
    if blob.role == "kernels" and not config.ship_kernels:
        return "kernels disabled by configuration"
    if blob.role == "toolchain" and not config.ship_toolchain:
        return "toolchain disabled by configuration"
    if blob.role in ("kernels", "toolchain"):
        return relocate.refusal(blob.meta)
    return ""


# -- place compiled artifacts where torch looks for them ----------------------------------
def place_artifacts(entry: Manifest, paths: dict[str, Path], result: LoadResult, cap: int,
                    prefetched: PrefetchResult | None = None) -> None:
    """Unpack the entry's kernels and toolchain packs (unless the prefetch did)."""
    done = prefetched.placed if prefetched is not None else {}
    for role in ("kernels", "toolchain"):
        blob = entry.blob(role)
        if role not in paths or blob is None:
            continue
        count = done.get(blob.digest)
        if count is None:
            with blamed_on("unpack", blob.digest, entry.key):
                count = place(role, paths[role], cap)
        result.placed[role] = count
    if result.placed.get("kernels"):  # the ISA probe's libraries are on disk now
        vec_isa.probe_in_background()


def place(role: str, pack: Path, cap: int) -> int:
    """Unpack a kernels or toolchain pack where torch looks for those files; files written."""
    roots = {"kernels": (torch_env.inductor_cache_dir(), KERNEL_SUFFIXES),
             "toolchain": (torch_env.header_dir(), TOOLCHAIN_SUFFIXES)}
    if role not in roots:
        return 0
    root, suffixes = roots[role]
    ids = relocate.parse_index(read_index(pack))
    placed = _unpack_once(pack, root, suffixes, cap)
    relocate.recorder().learn(root, ids)  # torch finds them under its own local names
    return placed


PLACE_LOCK_TIMEOUT_S = 300.0
"""How long a rank waits for another of its node to finish placing a pack before placing
it alongside (every file is written atomically, so two placers only cost time)."""


def _unpack_once(pack: Path, root: Path, suffixes: tuple[str, ...], cap: int) -> int:
    """Unpack `pack` into `root` once per node; the number of its files there.

    The local ranks of a node start together and would each decompress and write the same
    files (a toolchain pack is ~20 MB packed, several times that unpacked): the first to
    take the pack's lock unpacks it and leaves the list of its files beside them; the others
    find the list, check those files are still there, and unpack nothing.
    """
    root.mkdir(parents=True, exist_ok=True)
    mark = root / f".megacache-placed-{pack.name}"
    lock = FileLock(str(root / f".megacache-placing-{pack.name}.lock"),
                    timeout=PLACE_LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except Timeout:  # a rank stuck while placing: place alongside it
        log.debug("megacache: placing %s alongside a rank that holds its lock", pack.name)
    try:
        names = _placed_names(mark, root)
        if names is None:
            present: set[str] = set()
            unpack(pack, root, suffixes=suffixes, cap=cap, present=present)
            names = sorted(present)
            tmp = mark.with_name(f"{mark.name}.{os.getpid()}.part")
            tmp.write_text(json.dumps(names))
            os.replace(tmp, mark)
        return len(names)
    finally:
        if lock.is_locked:
            lock.release()


def _placed_names(mark: Path, root: Path) -> list[str] | None:
    """The files a placing of this pack left in `root`, if every one is still there (a
    cleaner may have emptied TMPDIR since: then it is placed again)."""
    try:
        names = json.loads(mark.read_text())
        if isinstance(names, list) and all(
                isinstance(n, str) and (root / safe_name(n)).is_file() for n in names):
            return names
    except (OSError, ValueError):  # a list mangled since (or a name unsafe: PackError)
        pass
    return None


# -- verify and hot-load the Mega-Cache bundle --------------------------------------------
def load_bundle(entry: Manifest, paths: dict[str, Path], result: LoadResult, cap: int,
                prefetched: PrefetchResult | None = None) -> None:
    """Hand the entry's bundle to torch; `result` records the keys torch took from it."""
    ref = entry.blob("megacache")
    assert ref is not None
    ready = prefetched.bundles.pop(ref.digest, None) if prefetched is not None else None
    if ready is None:
        with blamed_on("decompress", ref.digest, entry.key):
            ready = read_bundle(ref, paths["megacache"], cap)
    with blamed_on("load", None, entry.key):  # every blob verified: the entry is at fault
        artifacts = _torch_loads(torch_env.read_artifacts, ready)
        if artifacts is None:
            raise PackError("torch refused the bundle (load_cache_artifacts returned None)")
        artifacts, result.precompile = precompile.for_loading(artifacts, result.outcome, ref)
        keys = _torch_loads(torch_env.populate, artifacts)
    if keys.get(precompile.ARTIFACT_TYPE):
        precompile.reserve_ids(ref)
    if result.precompile:
        log.info("megacache: %s", result.precompile)
    result.loaded_keys = {(kind, k) for kind, ks in keys.items() for k in ks}


def _torch_loads(step: Callable[[Any], T], arg: Any) -> T:
    """torch's part of loading a bundle; torch raising there is the bundle's fault
    (reported as such), not a reason to call the server down."""
    try:
        return step(arg)
    except Exception as exc:
        raise PackError(f"torch could not load the bundle: {type(exc).__name__}: "
                        f"{exc}"[:500]) from exc


def read_bundle(ref: BlobRef, path: Path, cap: int) -> bytes:
    """A downloaded (verified) bundle blob as the bytes torch loads: decompressed with a size
    cap and checked against the manifest's raw size and digest."""
    data = path.read_bytes()
    if ref.compression != "zstd":
        return data
    if ref.raw_size is None:
        raise PackError("compressed bundle without raw_size")
    return decompress_bytes(data, ref.raw_size, ref.raw_sha256, cap)


# -- the headers the prefetch thread places last ------------------------------------------
def await_toolchain(prefetcher: Prefetcher | None, entry: Manifest | None, result: LoadResult,
                    wait_s: float, prefetched: PrefetchResult | None = None) -> None:
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
    deadline = time.monotonic() + wait_s

    def wait_for_headers() -> None:
        started = time.monotonic()
        count_toolchain(prefetcher, result, max(0.0, deadline - started))
        result.steps.setdefault("toolchain", round(time.monotonic() - started, 4))

    if not relocate.recorder().hold_headers(wait_for_headers):
        wait_for_headers()


def count_toolchain(prefetcher: Prefetcher | None, result: LoadResult, timeout: float
                    ) -> None:
    """The prefetch's toolchain pack, once in place, counted in `result`."""
    if prefetcher is None or not prefetcher.wait_toolchain(timeout):
        return
    done = prefetcher.result
    if done.toolchain is not None and done.toolchain in done.placed and \
            "toolchain" not in result.placed:
        result.placed["toolchain"] = done.placed[done.toolchain]
        result.bytes_down += done.toolchain_bytes


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
