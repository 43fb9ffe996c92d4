"""The lean ListObjectsV2 parse fsck lists blobs with, against a real SeaweedFS.

It must give the same keys and sizes as botocore's own parse, across continuation pages,
and leave errors and bodies it does not recognise to botocore.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from benchmarks.harness.servers import LocalSeaweedS3
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


def test_the_listing_ranges_cover_every_key_once(s3_service: LocalSeaweedS3) -> None:
    """The blob store lists `cas/` in key ranges at once: every key is listed exactly once,
    a digest of every leading hex digit, a key right on a range's bound, keys sorting
    before and after every hex digit, a key XML must escape, and pages that run past a
    range's end (two keys a page)."""
    client = _client(s3_service, lean=False)
    client.create_bucket(Bucket="ranges")
    expected: list[tuple[str, int]] = []
    for first in "0123456789abcdef":
        for i in range(3):
            digest = first + hashlib.sha256(f"{first}{i}".encode()).hexdigest()[1:]
            client.put_object(Bucket="ranges", Key=f"cas/{digest[:2]}/{digest}", Body=b"x" * i)
            expected.append((digest, i))
    for odd in ("1", "f", "0", "-early", "g", "zz/late", "ab/a&b=c"):
        client.put_object(Bucket="ranges", Key=f"cas/{odd}", Body=b"odd")
        expected.append((odd.rsplit("/", 1)[-1], 3))
    client.put_object(Bucket="ranges", Key="elsewhere/not-a-blob", Body=b"1")

    async def listed() -> list[tuple[str, int]]:
        store = S3BlobStore("ranges", endpoint_url=s3_service.endpoint,
                            access_key="test", secret_key="test")
        await store.open()
        store.listing_page_size = 2
        return [item async for item in store.digests()]

    assert sorted(asyncio.run(listed())) == sorted(expected)


def _operation(name: str) -> Any:
    import boto3

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
    return client.meta.service_model.operation_model(name)


PAGE = (b'<?xml version="1.0" encoding="UTF-8"?>\n'
        b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        b"<Name>b</Name><Prefix>cas/</Prefix><KeyCount>2</KeyCount><IsTruncated>true"
        b"</IsTruncated><NextContinuationToken>tok&amp;1</NextContinuationToken>"
        b"<Contents><Key>cas/a&amp;b</Key><LastModified>2026-12-03T00:00:00Z</LastModified>"
        b"<Size>7</Size></Contents>"
        b"<Contents><Size>9</Size><Key>cas/cd/cd01</Key></Contents>"
        b"<CommonPrefixes><Prefix>cas/zz/</Prefix></CommonPrefixes></ListBucketResult>")


def test_a_plain_page_is_read_without_botocore() -> None:
    response = {"status_code": 200, "body": PAGE, "headers": {}}
    custom: dict[str, Any] = {}
    s3_listing.parse_page(response, custom, operation_model=_operation("ListObjectsV2"))
    assert custom["Contents"] == [{"Key": "cas/a&b", "Size": 7},
                                  {"Key": "cas/cd/cd01", "Size": 9}]
    assert custom["IsTruncated"] is True and custom["NextContinuationToken"] == "tok&1"
    assert custom["Prefix"] == "cas/"  # the page's, not a common prefix's
    assert response["status_code"] == 200 and response["body"] != PAGE


@pytest.mark.parametrize(("body", "status"), [
    (PAGE[:len(PAGE) // 2], 500),  # cut off mid-way, as a dropped connection leaves it
    (b"<Error><Code>InternalError</Code><Message>We encountered an error</Message></Error>",
     500),
    # well-formed XML with odd content: left as it is, for botocore's own parser to read
    (PAGE.replace(b"<Size>7</Size>", b"<Size>seven</Size>"), 200),
    (PAGE.replace(b"<Key>cas/cd/cd01</Key>", b""), 200),
])
def test_a_page_it_cannot_read_gets_botocores_200_error_check(body: bytes, status: int) -> None:
    """botocore's check of a 200 body for an error now runs here for listings: a broken or
    error page still becomes a 500 that botocore retries, and its body stays untouched."""
    response = {"status_code": 200, "body": body, "headers": {}}
    custom: dict[str, Any] = {}
    s3_listing.parse_page(response, custom, operation_model=_operation("ListObjectsV2"))
    assert custom == {} and response["body"] == body
    assert response["status_code"] == status


def test_other_operations_keep_botocores_200_error_check(s3_service: LocalSeaweedS3) -> None:
    client = _client(s3_service, lean=True)
    error = b"<Error><Code>InternalError</Code><Message>copy failed</Message></Error>"
    for name in ("CompleteMultipartUpload", "ListObjectsV2"):
        response = {"status_code": 200, "body": error, "headers": {}}
        client.meta.events.emit(f"before-parse.s3.{name}", operation_model=_operation(name),
                                response_dict=response, customized_response_dict={})
        assert response["status_code"] == 500, name
