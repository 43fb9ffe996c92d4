"""Entries as a caller sees them: a manifest is stored exactly as validated, only once every
blob it names is stored, and an entry of another namespace does not exist for the caller
(404, no hint, and its LRU rank left alone)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from anyio import to_thread

from megacache_client.wire.manifest import Manifest, component_digest
from megacache_client.wire.schema import SchemaError, parse_json
from megacache_client.wire.writers import WriterPolicy
from megacache_server.errors import NotFound, Unprocessable
from megacache_server.service.caching.blobs import Blobs
from megacache_server.service.limits.quotas import Quotas
from megacache_server.service.security import provenance
from megacache_server.service.security.auth import Principal
from megacache_server.store.index.base import Index, NewEntry, Precondition, StoredEntry

MAX_SCANNED = 1000
"""Entries a listing with a writers policy reads at most to find the newest it trusts (a
listing's own limit): newer entries by untrusted writers beyond this hide older trusted
ones, and the consumer compiles."""
INLINE_PARSE_BYTES = 16 * 1024
"""Larger manifests are validated in a worker thread: a real one is 1-3 KiB (~0.2 ms), but
one of the 64 KiB allowed, full of fingerprint values, is ~5 ms of Python that every lookup
on the event loop would wait for."""


@dataclass(frozen=True)
class EntryWrite:
    entry: StoredEntry
    created: bool


class Entries:
    """Writes, lookups, listings, deletes and pins of entries, for one caller at a time."""

    def __init__(self, index: Index, blobs: Blobs, quotas: Quotas) -> None:
        self.index = index
        self.blobs = blobs
        self.quotas = quotas

    async def put_entry(self, principal: Principal, key: str, body: bytes,
                        condition: Precondition, *,
                        claims: provenance.ProducerClaims | None = None) -> EntryWrite:
        """Validate and store a manifest, exactly the bytes validated. Every blob it names
        must be stored and visible to the writer (424 if not). The entry records who wrote
        it (`service.security.provenance`): this caller's token, and what the producer `claims`.

        Listings and fallbacks order entries by when they were made, the manifest's
        `created_at` clamped to the server's clock: a producer's clock (or a writer's lie)
        in the future would keep its entry the newest, the fallback of every later job,
        for as long as it stands. The manifest bytes stay as written (they are signed)."""
        manifest = parse_manifest(body, key) if len(body) <= INLINE_PARSE_BYTES else \
            await to_thread.run_sync(parse_manifest, body, key)
        namespace = manifest.fingerprint.namespace
        principal.confined(namespace, "writes")
        size = await self.blobs.require_named(principal, manifest)
        await self.quotas.fit_entry(namespace, key, size)
        fp = manifest.fingerprint
        replaced = await self.index.get(key, touch=False) is not None
        now = time.time()
        written = provenance.record(principal, namespace,
                                    claims or provenance.ProducerClaims(),
                                    replaced=replaced, written_at=now)
        entry, created = await self.index.put(NewEntry(
            key=key, manifest_json=body, namespace=namespace, model=fp.model,
            env_digest=component_digest(fp.env), hw_digest=component_digest(fp.hw),
            digests=tuple(b.digest for b in manifest.blobs), size=size,
            created_at=min(manifest.created_at.timestamp(), now), provenance=written,
            sequence_floor=int(now * 1000)), condition)
        return EntryWrite(entry, created)

    async def get_entry(self, principal: Principal, key: str, *,
                        touch: bool = True) -> StoredEntry:
        """The entry if it exists in the caller's namespace; 404 otherwise. `touch` records
        the access for LRU eviction, only once the caller may see it."""
        entry = await self.index.get(key, touch=False)
        if entry is None or not principal.sees(entry.namespace):
            raise NotFound(f"no entry for key {key}", code="entry_not_found")
        return await self.index.touch(entry) if touch else entry

    async def list_entries(self, principal: Principal, *, namespace: str | None,
                           model: str | None, env: str | None, hw: str | None,
                           limit: int, writers: str | None = None) -> list[StoredEntry]:
        """Entries newest first. With `writers` (a consumer's trusted-writers policy,
        `wire.writers`), only entries whose provenance passes it, newest trusted first:
        the fallback a consumer is offered is one it would run (422 for a policy that is
        not one)."""
        policy = parse_policy(writers)
        scan = limit if policy is None else min(max(limit, 50), MAX_SCANNED)
        while True:
            found = await self.index.list_entries(
                namespace=principal.confined(namespace, "reads"), model=model,
                env_digest=env, hw_digest=hw, limit=scan)
            if policy is None:
                return found
            trusted = [e for e in found if not policy.refusal(e.provenance)]
            if len(trusted) >= limit or len(found) < scan or scan >= MAX_SCANNED:
                return trusted[:limit]
            scan = min(scan * 4, MAX_SCANNED)

    async def delete_entry(self, principal: Principal, key: str) -> None:
        await self.get_entry(principal, key, touch=False)
        if not await self.index.delete(key):
            raise NotFound(f"no entry for key {key}", code="entry_not_found")

    async def set_pinned(self, principal: Principal, key: str, pinned: bool) -> None:
        await self.get_entry(principal, key, touch=False)
        if not await self.index.set_pinned(key, pinned):
            raise NotFound(f"no entry for key {key}", code="entry_not_found")


def parse_policy(text: str | None) -> WriterPolicy | None:
    """A trusted-writers policy as the client's `MEGACACHE_TRUSTED_WRITERS` spells it; None
    for none (any writer); 422 `invalid_writers` naming the item that is not one."""
    if text is None:
        return None
    try:
        return WriterPolicy.parse(text)
    except ValueError as exc:
        raise Unprocessable(f"writers: {exc}", code="invalid_writers") from None


def parse_manifest(body: bytes, key: str) -> Manifest:
    """A manifest, strictly validated (non-finite numbers included), for the URL's key."""
    try:
        manifest = parse_json(Manifest, body)
    except SchemaError as exc:
        errors = exc.errors
        if errors and errors[0]["type"] == "json_invalid":
            raise Unprocessable(f"manifest is not valid JSON: {errors[0]['msg']}",
                                code="malformed_json") from None
        raise Unprocessable("manifest does not match the schema", code="invalid_manifest",
                            errors=errors) from None
    if manifest.key != key:
        raise Unprocessable(f"manifest key {manifest.key} differs from the URL key {key}",
                            code="key_mismatch")
    return manifest
