"""The cache service: every rule of the cache, in one place, bound to the caller.

Routes translate HTTP to calls on a `TenantCache` and back; the CLI, the background GC,
fsck and the dashboard call the same objects. Nothing else touches storage.

- `Cache` is the process-wide part: settings, storage, the GC lock, event rate limits, and
  who a request's token names (`Cache.authorized`).
- `TenantCache` is the cache as one principal sees it. Namespace visibility is decided by
  `TenantCache.scope` and nowhere else: a token of namespace B reads, lists, counts and
  reports only within B; auth off (loopback) sees every namespace.

Metrics subclass both (`service.metrics`) and override only what they count.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from anyio import to_thread

from megacache_client.wire.events import Event
from megacache_client.wire.manifest import Manifest, component_digest
from megacache_client.wire.schema import SchemaError, parse_json
from megacache_server.errors import (
    ApiError,
    Conflict,
    FailedDependency,
    Forbidden,
    InsufficientStorage,
    NotFound,
    ServiceUnavailable,
    TooManyRequests,
    Unprocessable,
)
from megacache_server.service import auth, eviction, fsck, provenance, reports, trust
from megacache_server.service.auth import Principal, Scope
from megacache_server.service.ratelimit import RateLimiter
from megacache_server.settings import Settings
from megacache_server.store.index.base import (
    MAX_CLAIM_LEASE_S,
    MAX_RESOLUTION_TTL_S,
    Claim,
    NewEntry,
    Precondition,
    QuarantineRecord,
    Resolution,
    StoredEntry,
    TokenRecord,
)
from megacache_server.store.storage import Storage

log = logging.getLogger("megacache.cache")

GC_LOCK = "gc"
GC_LOCK_TTL_S = 600.0
"""Longer than any collect takes; a replica that dies holding it blocks GC this long."""

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Job ids and claim holders: 1-128 of letters, digits, `.`, `_`, `-`, starting with a letter
or digit. No `/`, `:` or NUL (they name index records); `.` and `..` cannot match."""
MAX_ATTEMPT = 1_000_000
DEFAULT_RESOLUTION_TTL_S = 6 * 3600.0
"""How long a job attempt's resolution lives after the last rank asked, unless it says."""
DEFAULT_CLAIM_LEASE_S = 600.0
"""How long a publish claim lasts unless the claimant asks for another lease (or renews)."""


class Collector(Protocol):
    """Runs `Cache.collect` elsewhere (`collector.SubprocessCollector`: in a child process)."""

    async def collect(self, budget: int | None) -> eviction.GcResult | None: ...


class Cache:
    """The process-wide cache: storage plus the rules that are not about one caller."""

    def __init__(self, settings: Settings, storage: Storage,
                 collector: Collector | None = None) -> None:
        self.settings = settings
        self.storage = storage
        self.collector = collector
        self.event_limiter = RateLimiter(rate=self.settings.event_rate,
                                         burst=self.settings.event_burst)
        self.report_limiter = RateLimiter(rate=self.settings.report_rate,
                                          burst=self.settings.report_burst)
        self.found_good: dict[tuple[str, str], float] = {}
        """(reporter, blob) pairs a report had re-hashed and found good, with when
        (monotonic): reported again by the same token within trust.GOOD_VERDICT_TTL_S, the
        blob is not hashed again. Per reporter, so one tenant's reports of a good blob
        never delay the quarantine another's report of it rotten would make."""
        self._verifying: dict[str, asyncio.Future[trust.Verdict]] = {}
        self.uploading: dict[str, int] = {}
        """Bytes of uploads in flight in this process, per namespace: counted against the
        pending quota with what the index holds, so N connections cannot each pass it."""

    def bound(self, principal: Principal) -> TenantCache:
        return TenantCache(self, principal)

    async def authorized(self, authorization: str, scope: Scope) -> TenantCache:
        """The cache bound to the caller an `Authorization` header value names, who must
        hold `scope` (401 or 403 if not)."""
        principal = await auth.authenticate(self.settings, self.storage.index, authorization)
        return self.bound(auth.authorize(principal, scope))

    # -- maintenance: GC, eviction, fsck, readiness -----------------------------------
    @property
    def budget(self) -> int | None:
        budget = self.settings.store_budget
        return int(budget) if budget is not None else None

    async def gc_plan(self, *, budget: int | None = None) -> eviction.GcPlan:
        return await eviction.plan(self.storage, budget=budget if budget is not None
                                   else self.budget, grace_s=self.settings.gc_grace_s,
                                   low_water=self.settings.gc_low_water)

    async def collect(self, *, budget: int | None = None,
                      gc_plan: eviction.GcPlan | None = None) -> eviction.GcResult | None:
        """Evict over budget and collect unreferenced blobs, one collector at a time across
        every process and replica. None when another collector holds the lock.

        With a collector (the server's), the work runs there: the access times this
        process buffers are written first, so its LRU order is the one the plan reads."""
        index = self.storage.index
        if self.collector is not None and gc_plan is None:
            await index.flush_access()
            return await self.collector.collect(budget)
        if not await index.acquire_lock(GC_LOCK, ttl_s=GC_LOCK_TTL_S):
            return None
        try:
            gc_plan = gc_plan or await self.gc_plan(budget=budget)
            done = eviction.GcResult()
            if gc_plan.evict or gc_plan.delete:
                done = await eviction.apply(self.storage, gc_plan)
            await self._prune_events()
            await index.prune_jobs(time.time())
            return done
        finally:
            await index.release_lock(GC_LOCK)

    async def _prune_events(self) -> None:
        now = time.time()
        await self.storage.index.prune_events(
            raw_before=now - self.settings.event_retention_days * 86400,
            rollups_before=now - self.settings.rollup_retention_days * 86400)

    async def add_token(self, record: TokenRecord) -> None:
        await self.storage.index.put_token(record)

    async def tokens(self) -> list[TokenRecord]:
        return await self.storage.index.list_tokens()

    async def revoke_token(self, token_id: str) -> bool:
        return await self.storage.index.revoke_token(token_id)

    async def check(self, *, repair: bool, verify: bool) -> fsck.FsckReport:
        return await fsck.check(self.storage, repair=repair, verify=verify)

    async def ready(self) -> dict[str, str]:
        """Storage is reachable and can still write: a full disk is not ready."""
        for name, probe in ((self.storage.blobs.name, self.storage.blobs.ping),
                            (self.storage.index.name,
                             lambda: self.storage.index.ping(write=True))):
            try:
                await probe()
            except ApiError as exc:
                raise type(exc)(f"{name}: {exc.message}", code=exc.code) from exc
            except Exception as exc:  # any backend failure means not ready
                raise ServiceUnavailable(f"{name} unavailable: {exc}") from exc
        return {"status": "ready", "blobs": self.storage.blobs.name,
                "index": self.storage.index.name}


@dataclass(frozen=True)
class FallbackRule:
    """Which entry stands in for a missing key: the newest of `model` in `namespace` whose
    env and hw components have these digests (the client's own fallback rule)."""

    namespace: str
    model: str
    env: str
    hw: str


@dataclass(frozen=True)
class EntryWrite:
    entry: StoredEntry
    created: bool


class TenantCache:
    """The cache as one principal sees it."""

    def __init__(self, cache: Cache, principal: Principal) -> None:
        self.cache = cache
        self.storage = cache.storage
        self.index = cache.storage.index
        self.settings = cache.settings
        self.principal = principal

    # -- the one place namespaces are decided --------------------------------------------
    @property
    def scope(self) -> str | None:
        """The namespace this caller is confined to; None: all (auth off)."""
        return self.principal.namespace

    @property
    def home(self) -> str:
        """The namespace this caller's writes (blobs, events) belong to."""
        return self.principal.namespace or "default"

    def sees(self, namespace: str) -> bool:
        return self.scope is None or self.scope == namespace

    def _require_namespace(self, namespace: str | None, verb: str) -> str | None:
        if namespace is None or self.sees(namespace):
            return namespace if namespace is not None else self.scope
        raise Forbidden(f"token {self.principal.name!r} {verb} namespace {self.scope!r}, "
                        f"not {namespace!r}", code="namespace_mismatch")

    # -- blobs --------------------------------------------------------------------------
    async def put_blob(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool:
        """Store verified bytes; True if new to this caller's namespace (whether another
        team stored the same bytes is not this caller's to learn).

        Bytes new to this namespace pass its pending quota whether or not another team
        stored them: a 507 for new bytes and a 201 for another team's would tell that
        the bytes exist."""
        new_here = not await self.index.owns_blob(self.home, digest)
        with await self._reserve_pending(size if new_here else 0):
            if await self.storage.blobs.stat(digest) is None:
                await self._make_room(size)
            await self.storage.blobs.put(digest, size, body)
            created = await self.index.record_blob(digest, size, self.home)
        if await self.index.quarantined([digest]):  # verified again as it streamed in
            await self.index.clear_quarantined(digest)
        return created

    async def blob_size(self, digest: str) -> int | None:
        """The blob's size if this caller may see it, else None: asked of the store."""
        if not await self._may_see_blob(digest):
            return None
        return await self.storage.blobs.stat(digest)

    async def recorded_blob_size(self, digest: str) -> int | None:
        """HEAD's answer: the index's record of a blob the caller may see, else the store's.

        On S3 a stat is a request to another service (milliseconds, more in a cloud) for
        every blob a publish asks about before uploading it. The record
        is written only once the blob is committed and dropped when GC deletes it, so it
        says the same. A blob lost behind the server's back reads as stored until a
        manifest naming it is refused with 424, which drops that record (`_require_blobs`):
        the next publish uploads it again.
        """
        if not await self._may_see_blob(digest):
            return None
        record = await self.index.blob_record(digest)
        if record is not None:
            return record.size
        return await self.storage.blobs.stat(digest)

    async def _may_see_blob(self, digest: str) -> bool:
        return self.scope is None or await self.index.owns_blob(self.scope, digest)

    def read_blob(self, digest: str, start: int, end: int) -> AsyncIterator[bytes]:
        return self.storage.blobs.read(digest, start, end)

    def presigned_url(self, digest: str) -> str | None:
        """Where the client may read the blob itself, when redirects are on and the blob
        store can sign a URL; else None (the bytes go through this server)."""
        if not self.settings.s3_redirect:
            return None
        return self.storage.blobs.presigned_url(digest)

    async def _reserve_pending(self, size: int) -> contextlib.AbstractContextManager[None]:
        """Hold `size` bytes of the namespace's pending quota until the upload is recorded.

        Blobs no manifest names yet are capped per namespace: one tenant's unreferenced
        uploads can fill neither the store nor force out another tenant's entries. Uploads
        still streaming count too (checked and reserved with no await in between), so the
        cap holds however many connections a tenant opens to this process.
        """
        cap = self.settings.pending_cap()
        if cap is None or size == 0:
            return contextlib.nullcontext()
        pending = await self.index.pending_bytes(self.home)
        uploading = self.cache.uploading.get(self.home, 0)
        if pending + uploading + size > cap:
            raise InsufficientStorage(
                f"namespace {self.home!r} holds {pending} bytes of blobs no entry names and "
                f"{uploading} bytes in uploads; {size} more would pass its limit of {cap}: "
                "write the manifests that name them first", code="pending_quota",
                pending=pending + uploading, limit=cap)
        self.cache.uploading[self.home] = uploading + size
        return self._release_pending(size)

    @contextlib.contextmanager
    def _release_pending(self, size: int) -> Iterator[None]:
        try:
            yield
        finally:
            left = self.cache.uploading.get(self.home, 0) - size
            if left > 0:
                self.cache.uploading[self.home] = left
            else:
                self.cache.uploading.pop(self.home, None)

    async def _make_room(self, size: int) -> None:
        """Refuse an upload that would crowd others out; evict LRU entries for one that fits."""
        budget = self.cache.budget
        if budget is None:
            return
        used = await self.index.stored_bytes()
        if used + size <= budget:
            return
        await self.cache.collect(budget=max(0, budget - size))
        used = await self.index.stored_bytes()
        if used + size > budget:
            raise InsufficientStorage(
                f"store budget {budget} bytes: {used} used, {size} more do not fit even after "
                "evicting unpinned entries", code="store_full", used=used, budget=budget)

    # -- entries ------------------------------------------------------------------------
    async def put_entry(self, key: str, body: bytes, condition: Precondition, *,
                        claims: provenance.ProducerClaims | None = None) -> EntryWrite:
        """Validate and store a manifest, exactly the bytes validated. Every blob it names
        must be stored and visible to the writer (424 if not). The entry records who wrote
        it (`service.provenance`): this caller's token, and what the producer `claims`."""
        manifest = parse_manifest(body, key) if len(body) <= INLINE_PARSE_BYTES else \
            await to_thread.run_sync(parse_manifest, body, key)
        namespace = manifest.fingerprint.namespace
        self._require_namespace(namespace, "writes")
        size = await self._require_blobs(manifest)
        await self._enforce_quota(namespace, key, size)
        fp = manifest.fingerprint
        replaced = await self.index.get(key, touch=False) is not None
        written = provenance.record(self.principal, namespace,
                                    claims or provenance.ProducerClaims(),
                                    replaced=replaced, written_at=time.time())
        entry, created = await self.index.put(NewEntry(
            key=key, manifest_json=body, namespace=namespace, model=fp.model,
            env_digest=component_digest(fp.env), hw_digest=component_digest(fp.hw),
            digests=tuple(b.digest for b in manifest.blobs), size=size,
            created_at=manifest.created_at.timestamp(), provenance=written), condition)
        return EntryWrite(entry, created)

    async def get_entry(self, key: str, *, touch: bool = True) -> StoredEntry:
        """The entry if it exists in the caller's namespace; 404 otherwise (no hint)."""
        return await self._visible_entry(key, touch=touch)

    async def _visible_entry(self, key: str, *, touch: bool) -> StoredEntry:
        """`get_entry` for this class's own checks: a subclass that counts lookups by
        overriding `get_entry` does not count them."""
        entry = await self.index.get(key, touch=False)
        if entry is None or not self.sees(entry.namespace):  # and its LRU rank left alone
            raise NotFound(f"no entry for key {key}", code="entry_not_found")
        return await self.index.touch(entry) if touch else entry

    async def list_entries(self, *, namespace: str | None, model: str | None,
                           env: str | None, hw: str | None, limit: int) -> list[StoredEntry]:
        return await self.index.list_entries(
            namespace=self._require_namespace(namespace, "reads"), model=model,
            env_digest=env, hw_digest=hw, limit=limit)

    async def delete_entry(self, key: str) -> None:
        await self._visible_entry(key, touch=False)
        if not await self.index.delete(key):
            raise NotFound(f"no entry for key {key}", code="entry_not_found")

    async def set_pinned(self, key: str, pinned: bool) -> None:
        await self._visible_entry(key, touch=False)
        if not await self.index.set_pinned(key, pinned):
            raise NotFound(f"no entry for key {key}", code="entry_not_found")

    async def _require_blobs(self, manifest: Manifest) -> int:
        """Every named blob must be stored (and visible to the writer's namespace). Touching
        them first keeps garbage collection, which spares recently touched blobs, from
        deleting one between this check and the write. Returns their total size."""
        await self.index.touch_blobs([b.digest for b in manifest.blobs])
        missing, wrong_size = [], []
        for blob in manifest.blobs:
            size = await self.blob_size(blob.digest)
            if size is None:
                missing.append(blob.digest)
                if await self._may_see_blob(blob.digest):
                    await self.index.forget_blob(blob.digest)  # a record of a lost blob
            elif size != blob.size:
                wrong_size.append({"digest": blob.digest, "declared": blob.size,
                                   "stored": size})
        if missing:
            raise FailedDependency(
                f"{len(missing)} blob(s) named by the manifest are not stored; upload them "
                "first", missing=missing)
        if wrong_size:
            raise Unprocessable("blob sizes in the manifest differ from the stored blobs",
                                code="size_mismatch", blobs=wrong_size)
        return sum(b.size for b in manifest.blobs)

    async def _enforce_quota(self, namespace: str, key: str, size: int) -> None:
        """Over its quota, a namespace evicts its own least recently used entries, never
        another's; when its pinned entries alone fill it, the write is refused."""
        max_entries = self.settings.namespace_quota_entries
        max_bytes = self.settings.namespace_quota_bytes
        if max_entries is None and max_bytes is None:
            return
        entries, used = await self.index.usage(namespace)
        existing = await self.index.get(key, touch=False)
        if existing is not None:
            entries, used = entries - 1, used - existing.size

        def over(n: int, b: int) -> bool:
            return ((max_entries is not None and n + 1 > max_entries)
                    or (max_bytes is not None and b + size > int(max_bytes)))

        if not over(entries, used):
            return
        for victim in await self.index.lru_entries(256, namespace=namespace):
            if victim.key == key:
                continue
            if await self.index.delete(victim.key):
                entries, used = entries - 1, used - victim.size
                log.info("quota: evicted %s of namespace %s", victim.key, namespace)
            if not over(entries, used):
                return
        raise InsufficientStorage(
            f"namespace {namespace!r} is at its quota ({entries} entries, {used} bytes) with "
            "nothing left to evict", code="namespace_quota", entries=entries, used=used)

    # -- jobs: one resolution per job attempt, one publisher per key -----------------------
    async def resolve(self, key: str, *, job: str, attempt: int,
                      ttl_s: float = DEFAULT_RESOLUTION_TTL_S,
                      fallback: FallbackRule | None = None) -> Resolution:
        """What `key` means for this job attempt, the same for every rank: the first caller's
        answer (the entry this caller may see, or a miss) fixed for `ttl_s`, renewed as
        ranks ask. Records are the caller's namespace's: another tenant's job of the same
        name is another record, and the entry offered is only one this caller may read.

        With a `fallback`, a key without an entry resolves to the newest entry of that
        namespace and model with the same env and hw: the fallback is chosen once, here,
        since ranks that each listed entries at their own moment could choose apart."""
        job = require_id(job, "job")
        if isinstance(attempt, bool) or not isinstance(attempt, int) \
                or not 0 <= attempt <= MAX_ATTEMPT:
            raise Unprocessable(f"attempt must be an integer from 0 to {MAX_ATTEMPT}",
                                code="invalid_attempt")
        ttl_s = require_seconds(ttl_s, MAX_RESOLUTION_TTL_S, "ttl_s")
        try:
            candidate: StoredEntry | None = await self._visible_entry(key, touch=True)
        except NotFound:
            candidate = await self._fallback_candidate(fallback) if fallback else None
        done = await self.index.resolve(self.home, job, attempt, key, candidate, ttl_s,
                                        time.time())
        if done.hit and await self.index.quarantined(list(done.digests)):
            # the attempt's entry named a blob since quarantined: a miss from now on (its
            # bytes are gone; the ranks that had it met the bad blob and compile)
            return dataclasses.replace(done, manifest_json=b"", etag="")
        return done

    async def resolution_provenance(self, done: Resolution) -> str:
        """Who wrote the version a job attempt resolved to, while that version is still the
        entry ("" once it was replaced or removed: a reader that needs a trusted writer
        then compiles)."""
        entry = await self.index.get(done.key, touch=False)
        return entry.provenance if entry is not None and entry.etag == done.etag else ""

    async def _fallback_candidate(self, rule: FallbackRule) -> StoredEntry | None:
        newest = await self.list_entries(namespace=rule.namespace, model=rule.model,
                                         env=rule.env, hw=rule.hw, limit=1)
        if not newest:
            return None
        try:
            return await self._visible_entry(newest[0].key, touch=True)
        except NotFound:  # evicted since it was listed
            return None

    async def claim(self, key: str, *, holder: str,
                    lease_s: float = DEFAULT_CLAIM_LEASE_S) -> Claim:
        """Claim the publish of `key` in the caller's namespace for `lease_s` (claiming again
        renews it). 409 when another holder's lease is live: that one uploads."""
        holder = require_id(holder, "holder")
        lease_s = require_seconds(lease_s, MAX_CLAIM_LEASE_S, "lease_s")
        now = time.time()
        got = await self.index.claim(self.home, key, holder, lease_s, now)
        if not got.granted:
            remaining = max(0.0, got.expires_at - now)
            raise Conflict(
                f"key {key} is being published by {got.holder!r} (lease runs out in "
                f"{remaining:.0f}s): skip the upload; add what the entry lacks once it is "
                "written", code="claim_held", holder=got.holder, expires_at=got.expires_at,
                remaining_s=round(remaining, 3))
        return got

    async def release_claim(self, key: str, *, holder: str) -> None:
        """Give up `holder`'s claim (nothing to do if it lapsed); 409 if another holds it."""
        holder = require_id(holder, "holder")
        if not await self.index.release(self.home, key, holder, time.time()):
            raise Conflict(f"the claim on key {key} is held by another holder, not "
                           f"{holder!r}", code="claim_not_held")

    # -- reports: what clients met that was bad ------------------------------------------
    def _take_report(self) -> None:
        """Per token (per caller name with auth off, where there is one caller)."""
        wait = self.cache.report_limiter.take(self.principal.token_id or self.principal.name)
        if wait > 0:
            raise TooManyRequests(
                f"more than {self.settings.report_rate:g} reports/s from "
                f"{self.principal.name!r}; retry in {wait:.1f}s",
                headers={"retry-after": str(max(1, round(wait)))})

    async def report_blob(self, digest: str, *, kind: str, entry_key: str | None,
                          detail: str) -> dict[str, Any]:
        """A client met a bad blob: re-verify it from the store; quarantine it only if it is
        really bad. 404 for a blob this caller may not see (as GET). A blob that verifies
        but was reported undecodable counts, with its entry, as a report on that entry."""
        self._take_report()
        if not await self._may_see_blob(digest):
            raise NotFound(f"blob {digest} is not stored", code="blob_not_found")
        if await self.index.blob_record(digest) is None and \
                await self.storage.blobs.stat(digest) is None:
            raise NotFound(f"blob {digest} is not stored", code="blob_not_found")
        verdict = await self._verify(digest)
        if not verdict.ok:
            record = await trust.quarantine_blob(
                self.storage, digest, verdict, reporter=self.principal.name,
                claimed=f"{kind}: {detail}"[:200])
            return {"verdict": "quarantined", "reason": record.reason}
        answer: dict[str, Any] = {"verdict": "ok"}
        if entry_key is not None and kind in ("decompress", "unpack", "load"):
            entry = await self._visible_entry(entry_key, touch=False)
            if digest in entry.digests:
                answer |= await self._count_load_report(entry, kind, detail, job=None)
        return answer

    async def _verify(self, digest: str) -> trust.Verdict:
        """Re-hash once however many reports arrive together; trust a good verdict for a
        while (a flood of one token's reports about a good blob costs one hash)."""
        now = time.monotonic()
        reporter = self.principal.token_id or self.principal.name
        good_at = self.cache.found_good.get((reporter, digest))
        if good_at is not None and now - good_at < trust.GOOD_VERDICT_TTL_S:
            return trust.Verdict(True)
        running = self.cache._verifying.get(digest)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[trust.Verdict] = asyncio.get_running_loop().create_future()
        self.cache._verifying[digest] = future
        try:
            verdict = await trust.verify_blob(self.storage, digest)
            future.set_result(verdict)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            del self.cache._verifying[digest]
        if verdict.ok:
            if len(self.cache.found_good) > 10_000:
                self.cache.found_good.clear()
            self.cache.found_good[(reporter, digest)] = time.monotonic()
            await self.index.mark_verified(digest, time.time())
        return verdict

    async def report_entry(self, key: str, *, kind: str, detail: str,
                           job: str | None) -> dict[str, Any]:
        """torch could not load this entry's bundle. One report proves nothing (the reader's
        own torch may be at fault); `withdraw_after_reports` independent ones (distinct
        token and job) withdraw the entry the way a quarantine does."""
        self._take_report()
        if job is not None:
            job = require_id(job, "job")
        entry = await self._visible_entry(key, touch=False)
        return await self._count_load_report(entry, kind, detail, job=job)

    async def _count_load_report(self, entry: StoredEntry, kind: str, detail: str,
                                 job: str | None) -> dict[str, Any]:
        reporter = f"{self.principal.token_id or self.principal.name}/{job or '-'}"
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
            self.principal.name, time.time(), entry.size, (entry.namespace,),
            (f"{entry.namespace}/{entry.key}",))
        await self.index.add_quarantine(record)
        trust.log.warning("withdrew entry %s of namespace %s: torch could not load its bundle "
                          "(%d independent reports; last: %s: %s)", entry.key,
                          entry.namespace, count, kind, detail[:200])
        return {"verdict": "withdrawn", "reports": count, "needed": needed}

    async def quarantines(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """Quarantine records touching this caller's namespace, newest first."""
        return [vars(r) | {"namespaces": [n for n in r.namespaces if self.sees(n)],
                           "withdrawn": [w for w in r.withdrawn
                                         if self.sees(w.partition("/")[0])]}
                for r in await self.index.quarantines(namespace=self.scope, limit=limit)]

    # -- events and what they add up to ---------------------------------------------------
    async def add_event(self, body: bytes) -> None:
        """Record one run in the caller's namespace (from the token, never from the body)."""
        wait = 0.0
        if self.principal.namespace is not None:  # per token; auth off has none to key on
            wait = self.cache.event_limiter.take(self.principal.name)
        if wait > 0:
            raise TooManyRequests(
                f"more than {self.settings.event_rate:g} events/s from "
                f"{self.principal.name!r}; retry in {wait:.1f}s",
                headers={"retry-after": str(max(1, round(wait)))})
        try:
            event = parse_json(Event, body)
        except SchemaError as exc:
            raise Unprocessable("event does not match the schema", code="invalid_event",
                                errors=exc.errors) from None
        await self.index.add_event(self.home, event)

    async def stats(self, *, since: float | None) -> dict[str, Any]:
        found = await reports.stats(self.index, scope=self.scope, since=since)
        return {**found, "quarantine": await self.quarantine_summary()}

    async def jobs(self, *, limit: int) -> list[dict[str, Any]]:
        """The caller's jobs that reported last, with their attempts."""
        return await reports.jobs(self.index, scope=self.scope, limit=limit)

    async def dashboard(self, *, hours: float) -> dict[str, Any]:
        """Everything the dashboard shows, from rollups: cost independent of history."""
        found = await reports.dashboard(self.index, scope=self.scope,
                                        budget=self.cache.budget, hours=hours)
        return {**found, "quarantine": await self.quarantines(limit=20)}

    async def quarantine_summary(self) -> dict[str, Any]:
        """Quarantines by reason (of this caller's namespace: its records' count) and the
        latest records."""
        latest = await self.quarantines(limit=1000 if self.scope is not None else 20)
        if self.scope is None:
            by_reason = await self.index.quarantine_counts()
        else:
            by_reason = {}
            for record in latest:
                by_reason[record["reason"]] = by_reason.get(record["reason"], 0) + 1
        return {"by_reason": by_reason, "latest": latest[:20]}


def require_id(value: object, what: str) -> str:
    """A job id or holder as ID_PATTERN allows, or 422 naming the rule (never echoing a
    huge or binary value back whole)."""
    if isinstance(value, str) and ID_PATTERN.fullmatch(value):
        return value
    shown = repr(value)[:80] if isinstance(value, str) else type(value).__name__
    raise Unprocessable(f"{what} {shown} is not valid: 1-128 of A-Z a-z 0-9 . _ -, starting "
                        "with a letter or digit", code=f"invalid_{what}")


def require_seconds(value: object, limit: float, what: str) -> float:
    """A finite number of seconds in (0, limit], or 422."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 < value <= limit:
        raise Unprocessable(f"{what} must be a number of seconds above 0 and at most "
                            f"{limit:g}", code=f"invalid_{what.removesuffix('_s')}",
                            limit=limit)
    return float(value)


INLINE_PARSE_BYTES = 16 * 1024
"""Larger manifests are validated in a worker thread: a real one is 1-3 KiB (~0.2 ms), but
one of the 64 KiB allowed, full of fingerprint values, is ~5 ms of Python that every lookup
on the event loop would wait for."""


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
