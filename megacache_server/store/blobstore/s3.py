"""Blob store on any S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...).

An upload becomes visible only once its digest checked out: small blobs are buffered,
verified, then written with one PUT; large ones go up as a multipart upload to the final
key, and S3 shows nothing under that key until CompleteMultipartUpload, which is only sent
after the verification. A mismatch, a disconnect or a crashed replica leaves at most an
incomplete multipart upload, invisible to readers and aborted by `open()` after an hour.

boto3 is synchronous; every call runs in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio import to_thread

from megacache_server.errors import ServiceUnavailable
from megacache_server.settings import Settings
from megacache_server.store.blobstore import s3_listing
from megacache_server.store.blobstore.base import READ_CHUNK, BlobStore, DigestVerifier

log = logging.getLogger("megacache.s3")

DELETE_BATCH = 1000
"""Keys per DeleteObjects request: S3's limit, one request instead of a thousand."""
PART_SIZE = 16 * 1024 * 1024
"""Multipart part size: above S3's 5 MiB minimum, large enough for throughput."""

STALE_UPLOAD_AGE_S = 3600

LISTING_BOUNDS = "123456789abcdef"
"""Where the listing's key ranges split (after `cas/`): sixteen ranges of hex digests."""
LISTING_CONCURRENCY = 4
"""Ranges listed at once: enough to keep the store's listing busy while this process reads
the last page, few enough not to crowd a small store."""


class S3BlobStore(BlobStore):
    name = "s3"

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, access_key: str | None = None,
                 secret_key: str | None = None, create_bucket: bool = False,
                 presign_ttl_s: int = 300) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.region = region
        self.access_key = access_key
        self.secret_key = secret_key
        self.create_bucket = create_bucket
        self.presign_ttl_s = presign_ttl_s
        self._s3: Any = None
        self.listing_page_size = 1000  # S3's most; tests make it small to cross pages

    @classmethod
    def from_settings(cls, settings: Settings) -> S3BlobStore:
        return cls(settings.s3_bucket, settings.s3_prefix, endpoint_url=settings.s3_endpoint,
                   region=settings.s3_region, access_key=settings.s3_access_key,
                   secret_key=settings.s3_secret_key, create_bucket=settings.s3_create_bucket)

    def key_of(self, digest: str) -> str:
        return f"{self.prefix}cas/{digest[:2]}/{digest}"

    async def open(self) -> None:
        await to_thread.run_sync(self._open_sync)

    def _open_sync(self) -> None:
        import boto3
        from botocore.config import Config

        self._s3 = boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region or "us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3},
                          max_pool_connections=64, s3={"addressing_style": "path"}))
        s3_listing.register(self._s3)
        if self.create_bucket:
            try:
                self._s3.head_bucket(Bucket=self.bucket)
            except Exception:
                self._guard(lambda: self._s3.create_bucket(Bucket=self.bucket))
        # best effort: a store that refuses the listing still serves blobs
        with contextlib.suppress(Exception):
            self._abort_stale_uploads()

    def _abort_stale_uploads(self) -> None:
        cutoff = time.time() - STALE_UPLOAD_AGE_S
        pages = self._s3.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}cas/")
        for page in pages:
            for up in page.get("Uploads", []):
                if up["Initiated"].timestamp() < cutoff:
                    self._s3.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"],
                                                    UploadId=up["UploadId"])

    def _guard(self, fn: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            raise ServiceUnavailable(f"S3 {code}: {exc}", code="store_unavailable") from exc
        except BotoCoreError as exc:
            raise ServiceUnavailable(f"S3 unreachable: {exc}", code="store_unavailable") from exc

    async def _call(self, fn: Any, *, limiter: anyio.CapacityLimiter | None = None) -> Any:
        return await to_thread.run_sync(self._guard, fn, limiter=limiter)

    async def stat(self, digest: str) -> int | None:
        from botocore.exceptions import ClientError

        def head() -> int | None:
            try:
                return int(self._s3.head_object(Bucket=self.bucket,
                                                Key=self.key_of(digest))["ContentLength"])
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise

        return await self._call(head)  # type: ignore[no-any-return]

    async def put(self, digest: str, size: int, body: AsyncIterator[bytes]) -> bool:
        verifier = DigestVerifier(digest, size)
        key = self.key_of(digest)
        if size <= PART_SIZE:
            data = bytearray()
            async for chunk in body:
                verifier.update(chunk)
                data += chunk
            verifier.check()
            return await self._commit(lambda: self._s3.put_object(
                Bucket=self.bucket, Key=key, Body=bytes(data), IfNoneMatch="*"))
        return await self._put_multipart(key, digest, verifier, body)

    async def _put_multipart(self, key: str, digest: str, verifier: DigestVerifier,
                             body: AsyncIterator[bytes]) -> bool:
        upload_id = (await self._call(lambda: self._s3.create_multipart_upload(
            Bucket=self.bucket, Key=key)))["UploadId"]
        parts: list[dict[str, Any]] = []
        completed = False

        async def send(data: bytes) -> None:
            number = len(parts) + 1
            await to_thread.run_sync(verifier.update, data)
            resp = await self._call(lambda: self._s3.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data))
            parts.append({"ETag": resp["ETag"], "PartNumber": number})

        try:
            buffer = bytearray()
            async for chunk in body:
                buffer += chunk
                if len(buffer) >= PART_SIZE:
                    await send(bytes(buffer[:PART_SIZE]))
                    del buffer[:PART_SIZE]
            if buffer:
                await send(bytes(buffer))
            verifier.check()
            created = await self._commit(lambda: self._s3.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, IfNoneMatch="*"))
            completed = created
            return created
        finally:
            if not completed:
                await to_thread.run_sync(self._abort, key, upload_id)

    async def _commit(self, write: Any) -> bool:
        """Make a verified blob visible with a create-only write: True if this call created it.

        `If-None-Match: *` makes concurrent uploads of one blob end with exactly one
        creator, as `link()` does for the fs store. It is made whether or not the blob is
        stored already (no stat first): an upload of stored bytes costs what a new one
        does, so its time cannot tell a tenant that another stored them (a store that
        ignores the condition rewrites the same verified bytes).
        """
        from botocore.exceptions import ClientError

        def attempt() -> bool:
            try:
                write()
                return True
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status in (409, 412):
                    return False
                raise

        return await self._call(attempt)  # type: ignore[no-any-return]

    def _abort(self, key: str, upload_id: str) -> None:
        # an unaborted upload is invisible and is cleaned at the next start
        with contextlib.suppress(Exception):
            self._s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    async def read(self, digest: str, start: int = 0, end: int | None = None
                   ) -> AsyncIterator[bytes]:
        span = f"bytes={start}-{'' if end is None else end - 1}"
        resp = await self._call(lambda: self._s3.get_object(
            Bucket=self.bucket, Key=self.key_of(digest), Range=span))
        stream = resp["Body"]
        try:
            while chunk := await to_thread.run_sync(stream.read, READ_CHUNK):
                yield chunk
        finally:
            await to_thread.run_sync(stream.close)

    async def delete(self, digest: str) -> bool:
        if await self.stat(digest) is None:
            return False
        await self._call(lambda: self._s3.delete_object(Bucket=self.bucket,
                                                        Key=self.key_of(digest)))
        return True

    def quarantine_key(self, digest: str) -> str:
        return f"{self.prefix}quarantine/{digest}"

    async def quarantine(self, digest: str, reason: str) -> bool:
        """Copy the object under `quarantine/` (with the reason as metadata), then delete it
        from `cas/`: outside the prefix the store lists, serves and collects."""
        if await self.stat(digest) is None:
            return False
        try:  # one CopyObject: up to 5 GiB; past it the bad bytes are only deleted
            await self._call(lambda: self._s3.copy_object(
                Bucket=self.bucket, Key=self.quarantine_key(digest),
                CopySource={"Bucket": self.bucket, "Key": self.key_of(digest)},
                Metadata={"reason": reason.encode("ascii", "replace").decode()[:200]},
                MetadataDirective="REPLACE"))
        except ServiceUnavailable as exc:
            log.warning("quarantine: could not keep blob %s aside (%s); deleting it", digest,
                        exc)
        await self._call(lambda: self._s3.delete_object(Bucket=self.bucket,
                                                        Key=self.key_of(digest)))
        return True

    async def delete_many(self, digests: list[str]) -> set[str]:
        """DeleteObjects, DELETE_BATCH keys a request (deleting a missing key succeeds)."""
        failed: set[str] = set()
        for i in range(0, len(digests), DELETE_BATCH):
            part = digests[i:i + DELETE_BATCH]
            answer = await self._call(lambda part=part: self._s3.delete_objects(
                Bucket=self.bucket, Delete={"Quiet": True, "Objects": [
                    {"Key": self.key_of(d)} for d in part]}))
            failed |= {e["Key"].rsplit("/", 1)[-1] for e in answer.get("Errors", [])}
        return failed

    async def digests(self) -> AsyncIterator[tuple[str, int]]:
        """Listed in sixteen key ranges (split at LISTING_BOUNDS), LISTING_CONCURRENCY at a
        time: one listing is a thousand keys a round trip, each waiting on the store's own
        listing, so a million blobs listed in one sequence spent most of fsck waiting. The
        ranges cover every key under `cas/` exactly once, whatever its name."""
        base = f"{self.prefix}cas/"
        bounds: list[str | None] = [None, *(base + c for c in LISTING_BOUNDS), None]
        parts: list[list[tuple[str, int]]] = [[] for _ in range(len(bounds) - 1)]
        limiter = anyio.CapacityLimiter(LISTING_CONCURRENCY)

        async def shard(i: int) -> None:
            parts[i] = await self._call(
                lambda: self._list_range(base, bounds[i], bounds[i + 1]), limiter=limiter)

        async with anyio.create_task_group() as tg:
            for i in range(len(parts)):
                tg.start_soon(shard, i)
        for part in parts:
            for item in part:
                yield item

    def _list_range(self, base: str, after: str | None, upto: str | None
                    ) -> list[tuple[str, int]]:
        """(digest, size) of every key under `base` in (after, upto]; None: unbounded."""
        found: list[tuple[str, int]] = []
        params = {"Bucket": self.bucket, "Prefix": base}
        if after is not None:
            params["StartAfter"] = after
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            **params, PaginationConfig={"PageSize": self.listing_page_size})
        for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if upto is not None and key > upto:  # S3 lists in UTF-8 byte order: str order
                    return found
                found.append((key.rsplit("/", 1)[-1], int(obj["Size"])))
        return found

    async def ping(self) -> None:
        await self._call(lambda: self._s3.head_bucket(Bucket=self.bucket))

    def presigned_url(self, digest: str) -> str | None:
        """A time-limited URL for the blob, so large reads can bypass the server."""
        return str(self._s3.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self.key_of(digest)},
            ExpiresIn=self.presign_ttl_s))
