"""Blobs as a caller sees them: the CAS dedupes bytes across namespaces, but a caller sees
only blobs its namespace uploaded, so nobody can probe for content another team stored."""

from __future__ import annotations

from collections.abc import AsyncIterator

from megacache_client.wire.manifest import Manifest
from megacache_server.errors import FailedDependency, Unprocessable
from megacache_server.service.limits.quotas import Quotas
from megacache_server.service.security.auth import Principal
from megacache_server.settings import Settings
from megacache_server.store.storage import Storage


class Blobs:
    """Uploads, sizes and reads of blobs, each checked against the caller's namespace."""

    def __init__(self, settings: Settings, storage: Storage, quotas: Quotas) -> None:
        self.settings = settings
        self.storage = storage
        self.index = storage.index
        self.quotas = quotas

    async def put_blob(self, principal: Principal, digest: str, size: int,
                       body: AsyncIterator[bytes]) -> bool:
        """Store verified bytes; True if new to this caller's namespace (whether another
        team stored the same bytes is not this caller's to learn).

        Bytes new to this namespace are taken exactly as if nobody had stored them: the
        same hold on its pending quota, the same room made in the store's budget, the
        same writes, the same answer, and they count on its pending quota until one of
        its own entries names them (`BlobLedger.pending_bytes`): a 507, a count or a time
        that differed for another team's bytes would tell that they exist."""
        home = principal.home
        new_here = not await self.index.owns_blob(home, digest)
        async with self.quotas.pending(home, size if new_here else 0) as keep:
            if new_here:
                await self.quotas.make_room(size)
            await self.storage.blobs.put(digest, size, keep(body))
            created = await self.index.record_blob(digest, size, home)
        if await self.index.quarantined([digest]):  # verified again as it streamed in
            await self.index.clear_quarantined(digest)
        return created

    async def blob_size(self, principal: Principal, digest: str) -> int | None:
        """The blob's size if this caller may see it, else None: asked of the store."""
        if not await self.may_see(principal, digest):
            return None
        return await self.storage.blobs.stat(digest)

    async def recorded_blob_size(self, principal: Principal, digest: str) -> int | None:
        """HEAD's answer: the index's record of a blob the caller may see, else the store's.

        On S3 a stat is a request to another service (milliseconds, more in a cloud) for
        every blob a publish asks about before uploading it. The record
        is written only once the blob is committed and dropped when GC deletes it, so it
        says the same. A blob lost behind the server's back reads as stored until a
        manifest naming it is refused with 424, which drops that record (`require_named`):
        the next publish uploads it again.
        """
        if not await self.may_see(principal, digest):
            return None
        record = await self.index.blob_record(digest)
        if record is not None:
            return record.size
        return await self.storage.blobs.stat(digest)

    async def may_see(self, principal: Principal, digest: str) -> bool:
        return principal.namespace is None or \
            await self.index.owns_blob(principal.namespace, digest)

    def read_blob(self, digest: str, start: int, end: int) -> AsyncIterator[bytes]:
        return self.storage.blobs.read(digest, start, end)

    def presigned_url(self, digest: str) -> str | None:
        """Where the client may read the blob itself, when redirects are on and the blob
        store can sign a URL; else None (the bytes go through this server)."""
        if not self.settings.s3_redirect:
            return None
        return self.storage.blobs.presigned_url(digest)

    async def require_named(self, principal: Principal, manifest: Manifest) -> int:
        """Every blob a manifest names must be stored (and visible to the writer's
        namespace); returns their total size.

        Nothing is touched until every check passed: a refused write (424, 422) leaves each
        blob's last touch, by which garbage collection spares recent uploads, as it was, so
        no manifest that is refused keeps blobs alive (another tenant's least of all). Then
        the blobs are touched, and their records read again: a blob garbage collection
        deleted between the check and the touch (it reads touches again right before it
        deletes, and drops the record after) fails the write with 424 instead of leaving an
        entry that names it."""
        digests = [b.digest for b in manifest.blobs]
        recorded = set(await self.index.blob_records_of(digests))
        missing, wrong_size = [], []
        for blob in manifest.blobs:
            size = await self.blob_size(principal, blob.digest)
            if size is None:
                missing.append(blob.digest)
                if await self.may_see(principal, blob.digest):
                    await self.index.forget_blob(blob.digest)  # a record of a lost blob
            elif size != blob.size:
                wrong_size.append({"digest": blob.digest, "declared": blob.size,
                                   "stored": size})
        if not missing and not wrong_size:
            await self.index.touch_blobs(digests)
            missing = sorted(recorded - set(await self.index.blob_records_of(digests)))
        if missing:
            raise FailedDependency(
                f"{len(missing)} blob(s) named by the manifest are not stored; upload them "
                "first", missing=missing)
        if wrong_size:
            raise Unprocessable("blob sizes in the manifest differ from the stored blobs",
                                code="size_mismatch", blobs=wrong_size)
        return sum(b.size for b in manifest.blobs)
