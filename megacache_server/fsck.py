"""Consistency check between the index and the blob store: `megacache-server fsck`.

What a crash can leave behind, and what `--repair` does about it:
- an entry naming a blob the store lacks (should never happen: writes check first; a blob
  deleted by hand or lost by the store) → the entry is deleted;
- a blob record whose blob is gone → the record is dropped;
- a stored blob with no record (killed between commit and record) → recorded now, so
  garbage collection ages it out like any unreferenced blob;
- with `--verify`, a blob whose bytes no longer hash to its name → deleted (and the
  entries naming it with it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from megacache_client.manifest import Manifest
from megacache_server.storage import Storage

ALL = 10**9


@dataclass
class FsckReport:
    entries: int = 0
    blobs: int = 0
    dangling_entries: list[tuple[str, list[str]]] = field(default_factory=list)
    stale_records: list[str] = field(default_factory=list)
    unrecorded_blobs: list[tuple[str, int]] = field(default_factory=list)
    corrupt_blobs: list[str] = field(default_factory=list)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (self.dangling_entries or self.stale_records or self.unrecorded_blobs
                    or self.corrupt_blobs)

    def lines(self) -> list[str]:
        out = [f"{self.entries} entries, {self.blobs} blobs"]
        out += [f"dangling entry {k}: missing {', '.join(d[:12] for d in m)}"
                for k, m in self.dangling_entries]
        out += [f"stale blob record {d}" for d in self.stale_records]
        out += [f"unrecorded blob {d} ({n} bytes)" for d, n in self.unrecorded_blobs]
        out += [f"corrupt blob {d}" for d in self.corrupt_blobs]
        if self.clean:
            out.append("clean")
        elif self.repaired:
            out.append("repaired")
        return out


async def check(storage: Storage, *, repair: bool = False, verify: bool = False) -> FsckReport:
    report = FsckReport(repaired=repair)
    stored = {d: n async for d, n in storage.blobs.digests()}
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
    records = {b.digest for b in await storage.index.blob_records()}
    report.stale_records = sorted(records - set(stored))
    report.unrecorded_blobs = sorted((d, n) for d, n in stored.items() if d not in records)
    entries = await storage.index.list_entries(model=None, env_digest=None, hw_digest=None,
                                               limit=ALL)
    report.entries = len(entries)
    for entry in entries:
        digests = [b.digest for b in Manifest.model_validate_json(entry.manifest_json).blobs]
        missing = [d for d in digests if d not in stored]
        if missing:
            report.dangling_entries.append((entry.key, missing))
    if repair:
        for key, _ in report.dangling_entries:
            await storage.index.delete(key)
        for digest in report.stale_records:
            await storage.index.forget_blob(digest)
        for digest, size in report.unrecorded_blobs:
            await storage.index.record_blob(digest, size)
    return report


async def _content_digest(storage: Storage, digest: str) -> str:
    sha = hashlib.sha256()
    async for chunk in storage.blobs.read(digest):
        sha.update(chunk)
    return sha.hexdigest()
