"""The lean ListObjectsV2 parse fsck lists blobs with, against a real SeaweedFS.

It must give the same keys and sizes as botocore's own parse, across continuation pages,
and leave errors and bodies it does not recognise to botocore.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from services import LocalSeaweedS3

from megacache_server.store.blobstore import s3_listing
from megacache_server.store.blobstore.s3 import S3BlobStore


def _client(s3: LocalSeaweedS3, *, lean: bool) -> Any:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    if lean:
        s3_listing.register(client)
    return client


def _listed(client: Any, bucket: str, page_size: int) -> tuple[list[tuple[str, int]], int]:
    found, pages = [], 0
    for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix="cas/", PaginationConfig={"PageSize": page_size}):
        pages += 1
        found += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
    return found, pages


@pytest.fixture(scope="module")
def filled_bucket(s3_service: LocalSeaweedS3) -> dict[str, int]:
    client = _client(s3_service, lean=False)
    client.create_bucket(Bucket="listing")
    blobs = {}
    for i in range(7):
        body = b"x" * (i * 37)
        digest = hashlib.sha256(body + bytes([i])).hexdigest()
        client.put_object(Bucket="listing", Key=f"cas/{digest[:2]}/{digest}", Body=body)
        blobs[digest] = len(body)
    client.put_object(Bucket="listing", Key="elsewhere/not-a-blob", Body=b"1")
    return blobs


def test_lean_pages_match_botocores_parse(s3_service: LocalSeaweedS3,
                                          filled_bucket: dict[str, int]) -> None:
    lean, pages = _listed(_client(s3_service, lean=True), "listing", page_size=3)
    full, _ = _listed(_client(s3_service, lean=False), "listing", page_size=3)
    assert pages == 3  # 7 objects, 3 a page: the continuation tokens were followed
    assert lean == full
    assert sorted((k.rsplit("/", 1)[-1], n) for k, n in lean) == sorted(filled_bucket.items())


def test_the_hook_really_replaces_botocores_parse(s3_service: LocalSeaweedS3,
                                                  filled_bucket: dict[str, int]) -> None:
    page = _client(s3_service, lean=True).list_objects_v2(Bucket="listing", Prefix="cas/")
    assert page["Contents"] and all(set(o) == {"Key", "Size"} for o in page["Contents"])
    assert page["IsTruncated"] is False


def test_the_blob_store_lists_every_blob(s3_service: LocalSeaweedS3,
                                         filled_bucket: dict[str, int]) -> None:
    async def listed() -> dict[str, int]:
        store = S3BlobStore("listing", endpoint_url=s3_service.endpoint,
                            access_key="test", secret_key="test")
        await store.open()
        return {d: n async for d, n in store.digests()}

    assert asyncio.run(listed()) == filled_bucket


def test_errors_are_left_to_botocore(s3_service: LocalSeaweedS3) -> None:
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as err:
        _client(s3_service, lean=True).list_objects_v2(Bucket="no-such-bucket")
    assert err.value.response["Error"]["Code"] == "NoSuchBucket"


@pytest.mark.parametrize("body", [b"", b"<not xml", b"<Other><Contents/></Other>"])
def test_unrecognised_bodies_are_not_touched(body: bytes) -> None:
    response = {"status_code": 200, "body": body}
    custom: dict[str, Any] = {}
    s3_listing.parse_page(response, custom)
    assert response["body"] == body and custom == {}
