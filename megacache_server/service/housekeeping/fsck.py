"""Consistency check between the index and the blob store: `megacache-server fsck`.

What a crash can leave behind, and what `--repair` does about it:
- an entry naming a blob the store lacks (should never happen: writes check first; a blob
  deleted by hand or lost by the store) → the entry is deleted;
- a blob record whose blob is gone → the record is dropped;
- a stored blob with no record (killed between commit and record) → recorded now, so
  garbage collection ages it out like any unreferenced blob;
- with `--verify`, an entry whose manifest bytes no longer match their ETag (damaged in the
  index) or no longer pass validation → reported; `--repair` deletes it;
- with `--verify`, a blob whose bytes no longer hash to its name → deleted (and the
  entries naming it with it).

The blob digests of every entry come from the index's columns, not from parsing manifests:
a check of a million entries reads no manifest unless `--verify` asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from dataclasses import dataclass, field

from megacache_client.wire.manifest import Manifest
from megacache_client.wire.schema import SchemaError
from megacache_server.store.index.base import entry_etag
from megacache_server.store.storage import Storage

UNKNOWN_OWNER = "-"
"""Owner of blobs found on disk with no record: no token's namespace can be this."""


@dataclass
class FsckReport:
    entries: int = 0
    blobs: int = 0
    dangling_entries: list[tuple[str, list[str]]] = field(default_factory=list)
    stale_records: list[str] = field(default_factory=list)
    unrecorded_blobs: list[tuple[str, int]] = field(default_factory=list)
    corrupt_blobs: list[str] = field(default_factory=list)
    unreadable_entries: list[tuple[str, str]] = field(default_factory=list)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (self.dangling_entries or self.stale_records or self.unrecorded_blobs
                    or self.corrupt_blobs or self.unreadable_entries)

    def lines(self) -> list[str]:
        out = [f"{self.entries} entries, {self.blobs} blobs"]
        out += [f"dangling entry {k}: missing {', '.join(d[:12] for d in m)}"
                for k, m in self.dangling_entries]
        out += [f"stale blob record {d}" for d in self.stale_records]
        out += [f"unrecorded blob {d} ({n} bytes)" for d, n in self.unrecorded_blobs]
        out += [f"corrupt blob {d}" for d in self.corrupt_blobs]
        out += [f"unreadable entry {k}: {why}" for k, why in self.unreadable_entries]
        if self.clean:
            out.append("clean")
        elif self.repaired:
            out.append("repaired")
        return out


async def check(storage: Storage, *, repair: bool = False, verify: bool = False) -> FsckReport:
    report = FsckReport(repaired=repair)
    # the blob store's listing (S3: a thousand keys per request) and the index's reads
    # wait on different services: run together, fsck takes the longer of them, not the sum
    index_reads = asyncio.gather(storage.index.recorded_digests(),
                                 storage.index.entry_digests())
    try:
        stored = {d: n async for d, n in storage.blobs.digests()}
    except BaseException:
        index_reads.cancel()
        with contextlib.suppress(BaseException):
            await index_reads
        raise
    records, entries = await index_reads
    report.blobs = len(stored)
    if verify:
        for digest in sorted(stored):
            if await _content_digest(storage, digest) != digest:
                report.corrupt_blobs.append(digest)
        if repair:
            for digest in report.corrupt_blobs:
                await storage.blobs.delete(digest)
                await storage.index.forget_blob(digest)
                stored.pop(digest, None)
                records.discard(digest)
    report.stale_records = sorted(records - set(stored))
    report.unrecorded_blobs = sorted((d, n) for d, n in stored.items() if d not in records)
    report.entries = len(entries)
    for key in sorted(entries):
        missing = [d for d in entries[key] if d not in stored]
        if missing:
            report.dangling_entries.append((key, missing))
    if verify:
        report.unreadable_entries = await _unreadable(storage, sorted(entries))
    if repair:
        for key, _ in [*report.dangling_entries, *report.unreadable_entries]:
            await storage.index.delete(key)
        for digest in report.stale_records:
            await storage.index.forget_blob(digest)
        for digest, size in report.unrecorded_blobs:
            await storage.index.record_blob(digest, size, UNKNOWN_OWNER)
    return report


async def _content_digest(storage: Storage, digest: str) -> str:
    sha = hashlib.sha256()
    async for chunk in storage.blobs.read(digest):
        sha.update(chunk)
    return sha.hexdigest()


async def _unreadable(storage: Storage, keys: list[str]) -> list[tuple[str, str]]:
    """Entries whose stored manifest is damaged: reported one by one, never fatal."""
    found = []
    for key in keys:
        entry = await storage.index.get(key, touch=False)
        if entry is None:
            continue
        if entry_etag(entry.manifest_json) != entry.etag:
            found.append((key, "manifest bytes do not match their ETag"))
        else:
            try:
                Manifest.from_json(entry.manifest_json)
            except SchemaError as exc:
                found.append((key, f"manifest fails validation: {exc}"))
    return found
