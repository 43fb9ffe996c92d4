"""torch's Mega-Cache bundle in and out: save this process's, read one, load it, merge two.

torch's own calls (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`) work on
a whole bundle at once; the client needs the parts between (the artifacts of a bundle by
type and key, to merge a round into an entry, hold a rank's back, or leave unverified
precompiled output out), and a save that is safe from the publisher's thread while the
trainer compiles. They are here, apart from the environment probes (`env.py`), so that what
touches torch's cache internals is found under its own name.
"""

from __future__ import annotations

import contextlib
from typing import Any

from megacache_client.torch.env import torch_module

Artifacts = dict[str, list[Any]]
"""A Mega-Cache bundle read by torch: artifact type -> its artifacts (each has `.key`)."""


def read_artifacts(raw: bytes) -> Artifacts | None:
    """Mega-Cache bytes as torch's artifacts, or None if torch could not read them.

    The bytes of a process that saved more than once hold one chunk per type per save
    (torch appends); torch's own reader makes a dict of the chunks, so each type keeps
    only its last save's artifacts. Here the chunks of a type are joined (one artifact per
    key, the latest), so a second publish round ships the first round's graphs too."""
    from torch.compiler import _cache

    try:
        register = getattr(_cache.CacheArtifactManager, "_ensure_cache_artifacts_registered",
                           lambda: None)
        read_one = _cache._deserialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except (AttributeError, ImportError):  # another torch: its own reader, as it reads
        artifacts = _cache.CacheArtifactManager.deserialize(raw)
        return dict(artifacts) if artifacts is not None else None
    try:
        register()
        chunks = AppendingByteSerializer.to_list(raw, deserialize_fn=read_one)
    except Exception:
        return None
    out: dict[str, dict[str, Any]] = {}
    for kind, items in chunks:
        out.setdefault(kind, {}).update((a.key, a) for a in items)
    return {kind: list(by_key.values()) for kind, by_key in out.items()}


def populate(artifacts: Artifacts) -> dict[str, list[str]]:
    """Hot-load artifacts into torch's caches, as `torch.compiler.load_cache_artifacts`
    does after reading the bytes; returns the loaded keys per type."""
    from torch.compiler._cache import CacheArtifactManager

    info = CacheArtifactManager.populate_caches(artifacts)
    return {k: list(v) for k, v in info.artifacts.items()}


def without(artifacts: Artifacts, kind: str, keys: set[str] | None = None) -> Artifacts:
    """`artifacts` less those of type `kind` (only those of `keys` when given)."""
    return {k: [a for a in items if k != kind or (keys is not None and a.key not in keys)]
            for k, items in artifacts.items()}


def merged(base: Artifacts, new: Artifacts) -> Artifacts:
    """Both sets of artifacts, one per (type, key); `new`'s wins where both have one."""
    out = {kind: {a.key: a for a in items} for kind, items in base.items()}
    for kind, items in new.items():
        out.setdefault(kind, {}).update((a.key, a) for a in items)
    return {kind: list(by_key.values()) for kind, by_key in out.items() if by_key}


def keys_of(artifacts: Artifacts) -> dict[str, list[str]]:
    return {kind: [a.key for a in items] for kind, items in artifacts.items() if items}


def to_bytes(artifacts: Artifacts) -> bytes:
    """Artifacts as Mega-Cache bytes, in torch's own format (what `save_cache_artifacts`
    writes and `load_cache_artifacts` reads)."""
    from torch.compiler._cache import _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    writer: AppendingByteSerializer[Any] = AppendingByteSerializer(
        serialize_fn=_serialize_single_cache)
    writer.extend((k, v) for k, v in artifacts.items() if v)
    return bytes(writer.to_bytes())


def save_bundle(precompile: bool = False) -> tuple[bytes, dict[str, list[str]]] | None:
    """torch's Mega-Cache of this process so far (cumulative: torch keeps what it serialised
    before and appends), with its keys per type; None when torch recorded nothing.
    `precompile`: this process records precompiled Dynamo output (its packages are saved
    into the Mega-Cache first).

    Safe from a background thread while the trainer runs: Dynamo's compile lock guards
    torch's record of artifacts, and what a compile outside that lock (a lazily compiled
    backward) recorded while torch was serialising is queued again for the next save
    (`_requeue_unsaved`), never dropped. torch's settings are per thread (the trainer's
    `caching_precompile` is not this thread's), hence `precompile` is said, not read."""
    torch = torch_module()
    patch = torch._dynamo.config.patch(caching_precompile=True) if precompile \
        else contextlib.nullcontext()
    with compile_lock(), patch:
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return None
        raw, info = result
        keys = {k: list(v) for k, v in info.artifacts.items()}
        _requeue_unsaved(keys)
    return raw, keys


def compile_lock() -> Any:
    """Dynamo's compile lock (held while a frame compiles), or a no-op where torch has none."""
    try:
        from torch._dynamo.convert_frame import compile_lock as lock
    except Exception:
        return contextlib.nullcontext()
    return lock if hasattr(lock, "__enter__") else contextlib.nullcontext()


def artifacts_recorded() -> int:
    """How many cache artifacts torch has recorded in this process (compiled or served from
    a cache): it grows with every compile, so a count that stays put across a training step
    means the compiles have settled (`steps/settle.py`). Cheap, from any thread; -1 when
    torch cannot say."""
    try:
        from torch.compiler._cache import CacheArtifactManager

        return len(CacheArtifactManager._seen_artifacts)
    except Exception:
        return -1


def _requeue_unsaved(saved: dict[str, list[str]]) -> None:
    """Put back what torch recorded but did not serialise: `serialize` clears its list of
    new artifacts after writing, so one recorded in between (by a compile that does not
    hold the compile lock) would be left out of every later save."""
    try:
        from torch.compiler._cache import CacheArtifactManager as manager

        have = {(kind, k) for kind, ks in saved.items() for k in ks}
        for artifact in list(manager._seen_artifacts):
            kind = artifact.type()
            queued = manager._new_cache_artifacts.get(kind, [])
            if (kind, artifact.key) not in have and artifact not in queued:
                manager._new_cache_artifacts[kind].append(artifact)
    except Exception:  # torch's internals moved: the next save is as torch makes it
        return
