"""The load step: place the entry's packs where torch looks, and hand torch the bundle.

Kernels and headers are unpacked once per node; the Mega-Cache bundle is decompressed with
a size cap, checked against the manifest's raw size and digest, and loaded into torch's
caches. The placing helpers (`place`, `read_bundle`) are shared with the prefetch thread,
so a blob fetched early and one fetched by the load are checked and unpacked alike. Every
function raises on trouble: the session decides what a failure costs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock, Timeout

from megacache_client.errors import blamed_on
from megacache_client.results import LoadResult
from megacache_client.steps.prefetched import Prefetching, PrefetchResult
from megacache_client.torch import env as torch_env
from megacache_client.torch import megacache_io, precompile, ranks, relocate, vec_isa
from megacache_client.torch.packs import (
    PackError,
    decompress_bytes,
    pack_kind,
    read_index,
    safe_name,
    unpack,
)
from megacache_client.transport.trust import Admitted
from megacache_client.wire.manifest import Manifest

log = logging.getLogger("megacache")

KERNEL_SUFFIXES = (".so",)
TOOLCHAIN_SUFFIXES = (".h", ".gch")
T = TypeVar("T")


def watch_kernel_keys() -> str:
    """Watch torch key its kernels, so they ship and place by path-free identity; returns
    what that costs when it cannot ("" when it can)."""
    try:
        relocate.recorder().install()
    except Exception as exc:
        return f"kernels will only be reused at this torch path: {type(exc).__name__}: {exc}"
    return ""


# -- place compiled artifacts where torch looks for them ----------------------------------
def place_artifacts(admitted: dict[str, Admitted], result: LoadResult, cap: int,
                    prefetched: PrefetchResult | None = None) -> None:
    """Unpack the entry's kernels and toolchain packs (unless the prefetch did)."""
    done = prefetched.placed if prefetched is not None else {}
    for role in sorted(admitted):
        kind = pack_kind(role)
        if kind is None:
            continue
        blob = admitted[role].ref
        count = done.get(blob.digest)
        if count is None:
            with blamed_on("unpack", blob.digest, admitted[role].entry.key):
                count = place(admitted[role], cap)
        result.placed[kind] = result.placed.get(kind, 0) + count
    if result.placed.get("kernels"):  # the ISA probe's libraries are on disk now
        vec_isa.probe_in_background()


def place(admitted: Admitted, cap: int) -> int:
    """Unpack an admitted kernels or toolchain pack where torch looks for those files;
    the number of its files there. The only way a pack reaches torch's folders."""
    roots = {"kernels": (torch_env.inductor_cache_dir(), KERNEL_SUFFIXES),
             "toolchain": (torch_env.header_dir(), TOOLCHAIN_SUFFIXES)}
    kind = pack_kind(admitted.ref.role)
    if kind is None:
        return 0
    root, suffixes = roots[kind]
    pack = admitted.path
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
def load_bundle(bundle: Admitted, result: LoadResult, cap: int,
                prefetched: PrefetchResult | None = None) -> None:
    """Hand an admitted bundle to torch; `result` records the keys torch took from it.
    The only way a bundle reaches torch's caches."""
    ref, entry = bundle.ref, bundle.entry
    ready = prefetched.bundles.pop(ref.digest, None) if prefetched is not None else None
    if ready is None:
        with blamed_on("decompress", ref.digest, entry.key):
            ready = read_bundle(bundle, cap)
    with blamed_on("load", None, entry.key):  # every blob verified: the entry is at fault
        artifacts = _torch_loads(megacache_io.read_artifacts, ready)
        if artifacts is None:
            raise PackError("torch refused the bundle (load_cache_artifacts returned None)")
        result.withheld = ranks.withheld(artifacts, ref.meta, ranks.position())
        artifacts = ranks.less(artifacts, result.withheld)
        artifacts, result.precompile = precompile.for_loading(artifacts, result.outcome, ref)
        keys = _torch_loads(megacache_io.populate, artifacts)
    if keys.get(precompile.ARTIFACT_TYPE):
        precompile.reserve_ids(ref)
    if result.precompile:
        log.info("megacache: %s", result.precompile)
    if result.withheld:
        log.info("megacache: rank %s: %d artifact(s) compiled for other ranks not loaded "
                 "(compiled here if this rank needs them)", ranks.position(),
                 len(result.withheld))
    result.loaded_keys = {(kind, k) for kind, ks in keys.items() for k in ks}


def _torch_loads(step: Callable[[Any], T], arg: Any) -> T:
    """torch's part of loading a bundle; torch raising there is the bundle's fault
    (reported as such), not a reason to call the server down."""
    try:
        return step(arg)
    except Exception as exc:
        raise PackError(f"torch could not load the bundle: {type(exc).__name__}: "
                        f"{exc}"[:500]) from exc


def read_bundle(bundle: Admitted, cap: int) -> bytes:
    """An admitted bundle blob as the bytes torch loads: decompressed with a size cap and
    checked against the manifest's raw size and digest."""
    ref = bundle.ref
    data = bundle.path.read_bytes()
    if ref.compression != "zstd":
        return data
    if ref.raw_size is None:
        raise PackError("compressed bundle without raw_size")
    return decompress_bytes(data, ref.raw_size, ref.raw_sha256, cap)


# -- the headers the prefetch thread places last ------------------------------------------
def await_toolchain(prefetcher: Prefetching | None, entry: Manifest | None, result: LoadResult,
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


def count_toolchain(prefetcher: Prefetching | None, result: LoadResult, timeout: float
                    ) -> None:
    """The prefetch's toolchain pack, once in place, counted in `result`."""
    if prefetcher is None or not prefetcher.wait_toolchain(timeout):
        return
    done = prefetcher.result
    if done.toolchain is not None and done.toolchain in done.placed and \
            "toolchain" not in result.placed:
        result.placed["toolchain"] = done.placed[done.toolchain]
        result.bytes_down += done.toolchain_bytes


