"""Keeping bad bytes from being served again: re-verification, quarantine and the scrub.

A client that meets a blob failing its sha256 or size (or a bundle that does not decompress,
a pack that does not unpack, torch raising while loading it) reports it. The server never
takes the report's word: it re-hashes the blob from its own store, and only a blob whose
bytes really differ from their address (or from the recorded size, or that is gone) is
quarantined: moved aside by the blob store (`BlobStore.quarantine`), its record dropped, and
every entry naming it deleted so lookups, listings and fallbacks pass over it and the next
publish of the key (`If-None-Match: *` included) writes it afresh. Entries are deleted
rather than marked: an entry naming a quarantined blob can never be served again, and a
mark would be one more condition for every lookup, listing, quota and GC to keep, on both
index backends; what was withdrawn, and why, stays in the quarantine record.

A report about a good blob changes nothing, so a tenant cannot quarantine another's blobs;
reports are rate-limited per token, and a blob found good is not hashed again for a while
whoever reports it, so nobody can make the server hash all day.

The scrub (`Scrubber`) re-hashes stored blobs longest-unverified first at a bounded rate
(`MEGACACHE_SCRUB_BYTES_PER_S`), one process at a time across replicas (the `scrub` lock),
quarantining what fails, so rot is usually found before a client meets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass

from anyio import to_thread
from prometheus_client import Counter

from megacache_server.settings import Settings
from megacache_server.store.index.base import QuarantineRecord
from megacache_server.store.storage import Storage

log = logging.getLogger("megacache.trust")

SCRUB_LOCK = "scrub"
SCRUB_LOCK_TTL_S = 120.0
"""Taken for each blob for this long plus twice its hashing time at the budget: a scrubbing
replica that dies holds the scrub at most that long."""
SCRUB_BATCH = 64
SCRUB_REPORTER = "scrub"
"""The reporter of what the scrub quarantined."""
GOOD_VERDICT_TTL_S = 300.0
"""A blob found good is not hashed again on report for this long (per process)."""

SCRUB_BYTES = Counter("megacache_scrub_bytes_total", "Blob bytes the scrub re-hashed")
SCRUB_BLOBS = Counter("megacache_scrub_blobs_verified_total",
                      "Blobs the scrub re-hashed, by result", ["result"])
QUARANTINES = Counter("megacache_quarantines_made_total",
                      "Blobs this process quarantined, by reason and finder",
                      ["reason", "found_by"])


@dataclass(frozen=True)
class Verdict:
    """What re-reading a blob from the store found: ok, or what is wrong."""

    ok: bool
    reason: str = ""  # digest, size, missing
    detail: str = ""
    size: int = 0


async def verify_blob(storage: Storage, digest: str, *,
                      pace: float | None = None) -> Verdict:
    """Re-hash a stored blob (in worker threads, chunk by chunk; never whole in memory)
    against its address and the size the index recorded. `pace`: bytes per second to stay
    under (the scrub's budget); None: as fast as the store reads."""
    record = await storage.index.blob_record(digest)
    stored = await storage.blobs.stat(digest)
    if stored is None:
        return Verdict(False, "missing", "the blob store no longer holds it")
    if record is not None and record.size != stored:
        return Verdict(False, "size", f"recorded {record.size} bytes, stored {stored}",
                       stored)
    sha = hashlib.sha256()
    seen = 0
    started = time.monotonic()
    async for chunk in storage.blobs.read(digest, 0, stored):
        await to_thread.run_sync(sha.update, chunk)
        seen += len(chunk)
        if pace:
            SCRUB_BYTES.inc(len(chunk))
            ahead = seen / pace - (time.monotonic() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)
    if seen != stored:
        return Verdict(False, "size", f"read {seen} of {stored} bytes", stored)
    actual = sha.hexdigest()
    if actual != digest:
        return Verdict(False, "digest", f"the stored bytes hash to {actual}", stored)
    return Verdict(True, size=stored)


async def quarantine_blob(storage: Storage, digest: str, verdict: Verdict, *,
                          reporter: str, reporter_namespace: str = "",
                          claimed: str = "") -> QuarantineRecord:
    """Take a blob found bad out of service: every entry naming it deleted, the bytes moved
    aside, the record dropped, the quarantine recorded (with the reporter's namespace, which
    decides who may read the reporter and the detail) and logged with its reason."""
    index = storage.index
    namespaces = await index.blob_namespaces(digest)
    withdrawn = []
    for key in await index.entries_naming(digest):
        entry = await index.get(key, touch=False)
        if entry is not None and await index.delete(key):
            withdrawn.append(f"{entry.namespace}/{key}")
    if verdict.reason != "missing":
        await storage.blobs.quarantine(digest, f"{verdict.reason}: {verdict.detail}")
    await index.forget_blob(digest)
    detail = verdict.detail if not claimed else f"{verdict.detail} (reported: {claimed})"
    record = QuarantineRecord(digest, verdict.reason, detail[:500], reporter, time.time(),
                              verdict.size, tuple(namespaces), tuple(withdrawn),
                              reporter_namespace)
    await index.add_quarantine(record)
    QUARANTINES.labels(verdict.reason,
                       "scrub" if reporter == SCRUB_REPORTER else "report").inc()
    log.warning("quarantined blob %s (reason %s: %s; found by %s); withdrew %d entries%s",
                digest, verdict.reason, detail[:200], reporter, len(withdrawn),
                f": {', '.join(withdrawn[:10])}" if withdrawn else "")
    return record


class Scrubber:
    """Re-hashes stored blobs, longest-unverified first, at `bytes_per_s`, in the process that
    holds the scrub lock; blobs verified less than `interval_s` ago are left alone (the
    scrub sleeps until the oldest is due)."""

    def __init__(self, settings: Settings, storage: Storage) -> None:
        self.settings = settings
        self.storage = storage
        self.rate = float(settings.scrub_bytes_per_s)
        self.interval_s = settings.scrub_interval_s

    async def run_forever(self) -> None:
        while True:
            try:
                idle = await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # storage down: try again later
                log.warning("scrub failed: %s", exc)
                idle = 10.0
            await asyncio.sleep(idle)

    async def run_once(self) -> float:
        """Verify the blobs due now, each under the scrub lock (taken for as long as hashing
        it at the budget takes, and released after, so a replica that stops hands over);
        returns how long to wait before looking again."""
        index = self.storage.index
        due_before = time.time() - self.interval_s
        batch = await index.least_verified(SCRUB_BATCH)
        if not batch:
            return 5.0
        for record, verified_at in batch:
            if verified_at > due_before:
                return min(max(1.0, verified_at - due_before), 60.0)
            ttl = SCRUB_LOCK_TTL_S + 2 * record.size / self.rate
            if not await index.acquire_lock(SCRUB_LOCK, ttl_s=ttl):
                return SCRUB_LOCK_TTL_S / 4
            try:
                started = time.time()
                verdict = await verify_blob(self.storage, record.digest, pace=self.rate)
                if verdict.ok:
                    SCRUB_BLOBS.labels("ok").inc()
                    await index.mark_verified(record.digest, started)
                elif await index.blob_record(record.digest) is not None:
                    SCRUB_BLOBS.labels("failed").inc()
                    await quarantine_blob(self.storage, record.digest, verdict,
                                          reporter=SCRUB_REPORTER)
            finally:
                with contextlib.suppress(Exception):
                    await index.release_lock(SCRUB_LOCK)
        return 0.0
