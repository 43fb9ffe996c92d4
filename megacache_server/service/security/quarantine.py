"""What callers' reports can take out of service, and the records of what was.

A report is never taken at its word (`trust` says why): a blob reported bad is re-hashed
from the store and quarantined only if it really is bad; an entry torch could not load is
withdrawn only once enough independent callers said so.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from megacache_server.errors import NotFound
from megacache_server.service.caching.blobs import Blobs
from megacache_server.service.caching.entries import Entries
from megacache_server.service.caching.resolutions import require_id
from megacache_server.service.limits.quotas import Quotas
from megacache_server.service.security import trust
from megacache_server.service.security.auth import Principal
from megacache_server.settings import Settings
from megacache_server.store.index.base import QuarantineRecord, StoredEntry
from megacache_server.store.storage import Storage

MAX_GOOD_VERDICTS = 10_000
"""Good verdicts kept in memory (all forgotten at once past this)."""
IN_GENERAL = {
    "digest": "its stored bytes do not match their sha256",
    "size": "its stored size is not the size recorded",
    "missing": "the blob store no longer holds it",
    "load": "torch repeatedly could not load the entry's bundle",
}
"""Why a blob was quarantined (or an entry withdrawn), as another namespace is told it."""
SHOWN = ("digest", "reason", "detail", "reporter", "at", "size")


class Quarantine:
    """Reports of bad blobs and unloadable entries, and the quarantine records a caller
    may read."""

    def __init__(self, settings: Settings, storage: Storage, blobs: Blobs, entries: Entries,
                 quotas: Quotas) -> None:
        self.settings = settings
        self.storage = storage
        self.index = storage.index
        self.blobs = blobs
        self.entries = entries
        self.quotas = quotas
        self.found_good: dict[tuple[str, str], float] = {}
        """(reporter, blob) pairs a report had re-hashed and found good, with when
        (monotonic): reported again by the same token within trust.GOOD_VERDICT_TTL_S, the
        blob is not hashed again. Per reporter, so one tenant's reports of a good blob
        never delay the quarantine another's report of it rotten would make."""
        self._verifying: dict[str, asyncio.Future[trust.Verdict]] = {}

    async def report_blob(self, principal: Principal, digest: str, *, kind: str,
                          entry_key: str | None, detail: str) -> dict[str, Any]:
        """A client met a bad blob: re-verify it from the store; quarantine it only if it is
        really bad. 404 for a blob this caller may not see (as GET). A blob that verifies
        but was reported undecodable counts, with its entry, as a report on that entry."""
        await self.quotas.admit_report(principal)
        if not await self.blobs.may_see(principal, digest):
            raise NotFound(f"blob {digest} is not stored", code="blob_not_found")
        if await self.index.blob_record(digest) is None and \
                await self.storage.blobs.stat(digest) is None:
            raise NotFound(f"blob {digest} is not stored", code="blob_not_found")
        verdict = await self._verify(principal, digest)
        if not verdict.ok:
            record = await trust.quarantine_blob(
                self.storage, digest, verdict, reporter=principal.name,
                reporter_namespace=principal.namespace or "", claimed=f"{kind}: {detail}"[:200])
            return {"verdict": "quarantined", "reason": record.reason}
        answer: dict[str, Any] = {"verdict": "ok"}
        if entry_key is not None and kind in ("decompress", "unpack", "load"):
            entry = await self.entries.get_entry(principal, entry_key, touch=False)
            if digest in entry.digests:
                answer |= await self._count_load_report(principal, entry, kind, detail,
                                                        job=None)
        return answer

    async def _verify(self, principal: Principal, digest: str) -> trust.Verdict:
        """Re-hash once however many reports arrive together; trust a good verdict for a
        while (a flood of one token's reports about a good blob costs one hash)."""
        now = time.monotonic()
        reporter = principal.caller_id
        good_at = self.found_good.get((reporter, digest))
        if good_at is not None and now - good_at < trust.GOOD_VERDICT_TTL_S:
            return trust.Verdict(True)
        running = self._verifying.get(digest)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[trust.Verdict] = asyncio.get_running_loop().create_future()
        self._verifying[digest] = future
        try:
            verdict = await trust.verify_blob(self.storage, digest)
            future.set_result(verdict)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            del self._verifying[digest]
        if verdict.ok:
            if len(self.found_good) > MAX_GOOD_VERDICTS:
                self.found_good.clear()
            self.found_good[(reporter, digest)] = time.monotonic()
            await self.index.mark_verified(digest, time.time())
        return verdict

    async def report_entry(self, principal: Principal, key: str, *, kind: str, detail: str,
                           job: str | None) -> dict[str, Any]:
        """torch could not load this entry's bundle. One report proves nothing (the reader's
        own torch may be at fault); `withdraw_after_reports` independent ones (distinct
        token and job) withdraw the entry the way a quarantine does."""
        await self.quotas.admit_report(principal)
        if job is not None:
            job = require_id(job, "job")
        entry = await self.entries.get_entry(principal, key, touch=False)
        return await self._count_load_report(principal, entry, kind, detail, job=job)

    async def _count_load_report(self, principal: Principal, entry: StoredEntry, kind: str,
                                 detail: str, job: str | None) -> dict[str, Any]:
        reporter = f"{principal.caller_id}/{job or '-'}"
        count = await self.index.add_load_report(entry.key, entry.etag, reporter, time.time())
        needed = self.settings.withdraw_after_reports
        if count < needed:
            return {"verdict": "counted", "reports": count, "needed": needed}
        current = await self.index.get(entry.key, touch=False)
        if current is None or current.etag != entry.etag or \
                not await self.index.delete(entry.key):
            return {"verdict": "counted", "reports": count, "needed": needed}
        record = QuarantineRecord(
            "", "load", f"{count} independent reports; last: {kind}: {detail}"[:500],
            principal.name, time.time(), entry.size, (entry.namespace,),
            (f"{entry.namespace}/{entry.key}",), principal.namespace or "")
        await self.index.add_quarantine(record)
        trust.log.warning("withdrew entry %s of namespace %s: torch could not load its bundle "
                          "(%d independent reports; last: %s: %s)", entry.key,
                          entry.namespace, count, kind, detail[:200])
        return {"verdict": "withdrawn", "reports": count, "needed": needed}

    async def quarantines(self, principal: Principal, *, limit: int = 100
                          ) -> list[dict[str, Any]]:
        """Quarantine records touching this caller's namespace, newest first, naming only
        the namespaces and entries the caller may see. Who reported it and what they said
        are their namespace's: a reader of another namespace (one that owns the same bytes)
        learns that a blob it can see is quarantined and why in general terms
        (`IN_GENERAL`), never another tenant's token name or detail."""
        return [self._as_seen(principal, r)
                for r in await self.index.quarantines(namespace=principal.namespace,
                                                       limit=limit)]

    @staticmethod
    def _as_seen(principal: Principal, record: QuarantineRecord) -> dict[str, Any]:
        shown = {name: getattr(record, name) for name in SHOWN}
        ours = principal.namespace is None or record.reporter_namespace == principal.namespace \
            or (record.reporter == trust.SCRUB_REPORTER and not record.reporter_namespace)
        if not ours:
            shown |= {"reporter": "another namespace",
                      "detail": IN_GENERAL.get(record.reason, "found bad")}
        return shown | {"namespaces": [n for n in record.namespaces if principal.sees(n)],
                        "withdrawn": [w for w in record.withdrawn
                                      if principal.sees(w.partition("/")[0])]}

    async def quarantine_summary(self, principal: Principal) -> dict[str, Any]:
        """Quarantines by reason (of this caller's namespace: its records' count) and the
        latest records."""
        scoped = principal.namespace is not None
        latest = await self.quarantines(principal, limit=1000 if scoped else 20)
        if not scoped:
            by_reason = await self.index.quarantine_counts()
        else:
            by_reason = {}
            for record in latest:
                by_reason[record["reason"]] = by_reason.get(record["reason"], 0) + 1
        return {"by_reason": by_reason, "latest": latest[:20]}
