"""The fetch step: find the entry a compile should load, and bring its blobs to this node.

The exact fingerprint key first (or the job attempt's resolution of it, so every rank of a
job gets the same answer), else the newest entry of the same model on the same env and hw.
Each blob is downloaded once per node (`nodecache`) and verified against its digest and
size before anything reads it; what the prefetch thread already fetched is taken as it is.
Every function raises on trouble: the session decides what a failure costs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from megacache_client.config import ClientConfig
from megacache_client.errors import exc_text
from megacache_client.job import RESOLUTION_TTL_S, JobIdentity
from megacache_client.results import LoadResult
from megacache_client.steps.fingerprint import COMPONENTS, describe, differing
from megacache_client.steps.prefetched import Prefetching, PrefetchResult
from megacache_client.torch import relocate
from megacache_client.torch.packs import PackError, pack_kind
from megacache_client.transport.client import (
    CircuitOpenError,
    RemoteCache,
    ResolutionUnsupported,
    UntrustedEntryError,
    UntrustedWriterError,
)
from megacache_client.transport.nodecache import NodeCache
from megacache_client.transport.trust import Admitted, ServedEntry
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest, component_digest


# -- what the prefetch thread already fetched ----------------------------------------------
def await_prefetch(prefetcher: Prefetching | None, wait_s: float, result: LoadResult,
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


def failure_reason(prefetcher: Prefetching | None, exc: Exception) -> str:
    """Why the load failed, the root cause first: when it found the server marked down
    because this process's own prefetch (or the earlier one it continued) gave up on it,
    that prefetch's error is the reason, not the breaker it opened."""
    reason = exc_text(exc)
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


# -- find the entry (exact, else the nearest of the same model) ----------------------------
def find_entry(remote: RemoteCache, fp: Fingerprint, result: LoadResult, fallback: bool,
               prefetched: PrefetchResult | None = None, job: JobIdentity | None = None
               ) -> ServedEntry | None:
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
                ) -> ServedEntry | None:
    if job is not None and job.job_id is not None and job.shared:
        try:
            return _resolve_for_job(remote, fp, result, fallback, job)
        except ResolutionUnsupported as exc:
            result.job_note = str(exc)
    exact = prefetched.entry if prefetched is not None and prefetched.entry is not None \
        and prefetched.entry.key == fp.key() else remote.get_entry(fp.key())
    if exact is not None:
        _require_match(exact.manifest, fp, COMPONENTS)
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
            _require_match(got.manifest, fp, ("namespace", "model", "env", "hw"))
        return got
    result.differing = differing(candidates[0].fingerprint, fp)
    result.outcome = "miss"
    result.reason = (f"no entry for this fingerprint; the newest entry of {fp.model!r} "
                     f"differs in {describe(candidates[0].fingerprint, fp)}")
    return None


def _resolve_for_job(remote: RemoteCache, fp: Fingerprint, result: LoadResult,
                     fallback: bool, job: JobIdentity) -> ServedEntry | None:
    assert job.job_id is not None
    rule: dict[str, str] | None = None
    if fallback:  # the server picks the stand-in: by our rule, and of a writer we trust
        rule = {"namespace": fp.namespace, "model": fp.model, "env": component_digest(fp.env),
                "hw": component_digest(fp.hw)}
        if remote.config.trusted_writers:
            rule["writers"] = remote.config.trusted_writers
    got = remote.resolve_entry(fp.key(), job=job.job_id, attempt=job.attempt,
                               ttl_s=RESOLUTION_TTL_S, fallback=rule)
    whose = f"job {job.job_id} attempt {job.attempt}"
    if got is None:
        result.outcome = "miss"
        result.reason = f"no entry for this fingerprint when {whose} first looked"
        return None
    if got.key == fp.key():
        _require_match(got.manifest, fp, COMPONENTS)
        result.outcome, result.reason = "hit", f"exact fingerprint ({whose})"
        return got
    _require_match(got.manifest, fp, ("namespace", "model", "env", "hw"))
    result.differing = differing(got.manifest.fingerprint, fp)
    result.outcome = "fallback"
    result.reason = (f"exact key missed; using the newest entry of {fp.model!r} with the "
                     f"same env and hw when {whose} first looked (differs in "
                     f"{', '.join(result.differing)})")
    return got


# -- fetch each blob once per node, verified, admitted by the gate ------------------------
def fetch_blobs(remote: RemoteCache, config: ClientConfig, node: NodeCache,
                entry: ServedEntry, result: LoadResult,
                prefetched: PrefetchResult | None = None) -> dict[str, Admitted]:
    """role -> each blob of `entry` that can help here, on local disk and admitted by the
    gate (`verify.Gate.admit`: what the placing functions take)."""
    admitted: dict[str, Admitted] = {}
    ready = prefetched.paths if prefetched is not None else {}
    for blob in entry.manifest.blobs:
        skip = skip_reason(config, blob)
        if skip:
            result.skipped[blob.role] = skip
            continue
        if prefetched is not None and blob.digest == prefetched.toolchain:
            continue  # the prefetch thread is fetching and placing it (await_toolchain)
        path = ready.get(blob.digest)
        if path is None or not NodeCache.was_verified(path, blob.digest, blob.size):
            path, downloaded = fetch_blob(remote, node, blob)
            result.bytes_down += downloaded
        admitted[blob.role] = remote.gate.admit(entry, blob.role, path)
    if "megacache" not in admitted:
        raise PackError("entry has no megacache bundle blob")
    return admitted


def fetch_blob(remote: RemoteCache, node: NodeCache, blob: BlobRef) -> tuple[Path, int]:
    """One blob into the node cache, once per node, verified; the bytes downloaded."""
    return node.fetch(blob.digest, blob.size,
                      functools.partial(remote.download_blob, blob.digest, blob.size))


def skip_reason(config: ClientConfig, blob: BlobRef) -> str:
    """Why a compiled-artifact blob cannot help here (it would only cost a download)."""
    kind = pack_kind(blob.role)
    if kind == "kernels" and not config.ship_kernels:
        return "kernels disabled by configuration"
    if kind == "toolchain" and not config.ship_toolchain:
        return "toolchain disabled by configuration"
    if kind is not None:
        return relocate.refusal(blob.meta)
    return ""


def _require_match(entry: Manifest, fp: Fingerprint, components: tuple[str, ...]) -> None:
    """Refuse an entry whose fingerprint differs from ours in `components`."""
    names = [name for name in ("namespace", *components)
             if getattr(entry.fingerprint, name) != getattr(fp, name)]
    if names:
        raise UntrustedEntryError(f"entry {entry.key[:12]}… differs from this job in "
                                  f"{', '.join(dict.fromkeys(names))}: refusing it")

