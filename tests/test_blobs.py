"""The CAS over a real server: round trips, ranges, idempotence, concurrency, bad input."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import (
    LOOPBACK,
    ServerProcess,
    make_fingerprint,
    make_manifest,
    raw_http,
    sha256,
)

MiB = 1024 * 1024


def _chunks(data: bytes, size: int = MiB):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_64mib_round_trip_streams_and_resumes(server: ServerProcess, client: httpx.Client):
    data = os.urandom(64 * MiB)
    digest = sha256(data)
    r = client.put(f"/v1/cas/{digest}", content=_chunks(data),
                   headers={"content-length": str(len(data))})
    assert r.status_code == 201, r.text
    assert r.json() == {"digest": digest, "size": len(data), "created": True}

    head = client.head(f"/v1/cas/{digest}")
    assert head.status_code == 200
    assert int(head.headers["content-length"]) == len(data)

    got = bytearray()
    with client.stream("GET", f"/v1/cas/{digest}") as resp:
        assert resp.status_code == 200
        assert resp.headers["etag"] == f'"{digest}"'
        assert "immutable" in resp.headers["cache-control"]
        for chunk in resp.iter_bytes():
            got += chunk
            if len(got) >= 20 * MiB:  # the connection "breaks" here
                break
    resume_at = len(got)
    with client.stream("GET", f"/v1/cas/{digest}",
                       headers={"range": f"bytes={resume_at}-"}) as resp:
        assert resp.status_code == 206
        assert resp.headers["content-range"] == f"bytes {resume_at}-{len(data) - 1}/{len(data)}"
        for chunk in resp.iter_bytes():
            got += chunk
    assert sha256(bytes(got)) == digest
    assert server.temp_files() == []


def test_put_is_idempotent(client: httpx.Client):
    data = os.urandom(1000)
    digest = sha256(data)
    assert client.put(f"/v1/cas/{digest}", content=data).status_code == 201
    again = client.put(f"/v1/cas/{digest}", content=data)
    assert again.status_code == 200
    assert again.json()["created"] is False


def test_ranges(client: httpx.Client):
    data = bytes(range(256)) * 40
    digest = sha256(data)
    client.put(f"/v1/cas/{digest}", content=data)
    url = f"/v1/cas/{digest}"
    r = client.get(url, headers={"range": "bytes=10-19"})
    assert (r.status_code, r.content) == (206, data[10:20])
    r = client.get(url, headers={"range": "bytes=-5"})
    assert (r.status_code, r.content) == (206, data[-5:])
    r = client.get(url, headers={"range": f"bytes=100-{len(data) + 50}"})
    assert (r.status_code, r.content) == (206, data[100:])
    r = client.get(url, headers={"range": f"bytes={len(data)}-"})
    assert r.status_code == 416
    assert r.headers["content-range"] == f"bytes */{len(data)}"
    assert r.json()["error"]["code"] == "range_not_satisfiable"
    # multi-range and garbage are ignored: the whole blob, 200
    assert client.get(url, headers={"range": "bytes=0-1,5-6"}).content == data
    assert client.get(url, headers={"range": "pages=1-2"}).status_code == 200
    # If-Range with another validator: the whole blob
    r = client.get(url, headers={"range": "bytes=0-9", "if-range": '"other"'})
    assert (r.status_code, len(r.content)) == (200, len(data))
    assert client.get(url, headers={"if-none-match": f'"{digest}"'}).status_code == 304


def test_concurrent_uploads_of_one_blob_leave_one_copy(server: ServerProcess):
    data = os.urandom(4 * MiB)
    digest = sha256(data)

    def upload(_: int) -> int:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            return c.put(f"/v1/cas/{digest}", content=data).status_code

    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(upload, range(20)))
    assert sorted(codes) == [200] * 19 + [201]
    assert server.blob_names().count(digest) == 1
    assert sha256(server.read_stored(digest)) == digest
    assert server.temp_files() == []


@pytest.mark.parametrize("bad", [
    "abc",                                   # too short
    "A" * 64,                                # upper case
    "g" * 64,                                # not hex
    "0" * 63 + "/",                          # separator
    "..%2F..%2F..%2Fetc%2Fpasswd",           # traversal, encoded
    "0" * 65,                                # too long
])
def test_malformed_digest_is_refused_and_nothing_written(server, client, bad):
    before = server.blob_names()
    for method in ("PUT", "GET", "HEAD"):
        r = client.request(method, f"/v1/cas/{bad}", content=b"x" if method == "PUT" else None)
        assert r.status_code in (400, 404), (method, bad, r.status_code)
        if method != "HEAD" and r.status_code == 400:
            assert r.json()["error"]["code"] == "malformed_digest"
    assert server.blob_names() == before
    assert server.temp_files() == []


def test_traversal_never_reads_outside_the_store(server: ServerProcess):
    status, response = raw_http(server.port, b"GET /v1/cas/../../../../etc/passwd HTTP/1.1\r\n"
                                             b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status in (400, 404)
    assert b"root:" not in response


def test_digest_mismatch_is_400_and_leaves_nothing(server, client):
    data = os.urandom(3 * MiB)
    wrong = sha256(b"something else")
    r = client.put(f"/v1/cas/{wrong}", content=data)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "digest_mismatch"
    assert r.json()["error"]["actual"] == sha256(data)
    assert client.head(f"/v1/cas/{wrong}").status_code == 404
    assert client.head(f"/v1/cas/{sha256(data)}").status_code == 404
    assert server.temp_files() == []


def test_missing_content_length_is_411(server, client):
    data = b"chunked body"

    def gen():
        yield data

    r = client.put(f"/v1/cas/{sha256(data)}", content=gen())  # httpx sends it chunked
    assert r.status_code == 411
    assert r.json()["error"]["code"] == "length_required"
    assert client.head(f"/v1/cas/{sha256(data)}").status_code == 404


def _until(what: str, check: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_truncated_upload_is_never_visible_and_leaves_nothing(server: ServerProcess):
    """While the upload streams the blob is not there; once the client hangs up half way,
    nothing of it is. 17 MiB: over the S3 store's part size, so it streams as a multipart
    upload there (a temp file on disk): `temp_files()` shows it in flight on both stores."""
    data = os.urandom(17 * MiB)
    digest = sha256(data)
    head = (f"PUT /v1/cas/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with socket.create_connection((LOOPBACK, server.port), timeout=30) as s:
            s.sendall(head + data[: len(data) // 2])
            _until("the upload to be in flight", server.temp_files)
            assert c.head(f"/v1/cas/{digest}").status_code == 404
            assert c.get(f"/v1/cas/{digest}").status_code == 404
            assert digest not in server.blob_names()
        # the connection closed with half the body sent: the server notices asynchronously
        _until("the broken upload's leftovers to go", lambda: not server.temp_files())
        assert c.head(f"/v1/cas/{digest}").status_code == 404
        assert c.get(f"/v1/cas/{digest}").status_code == 404
        assert digest not in server.blob_names()
        # and the server is still fine
        assert c.put(f"/v1/cas/{digest}", content=data).status_code == 201
        assert c.get(f"/v1/cas/{digest}").content == data


def test_oversize_blob_is_413_before_the_body_is_read(limited_server: ServerProcess):
    size = 2 * 1024 * 1024
    digest = "0" * 64
    status, response = raw_http(
        limited_server.port,
        f"PUT /v1/cas/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Length: {size}\r\n\r\n".encode(),
    )
    assert status == 413, response
    assert b"payload_too_large" in response
    assert limited_server.temp_files() == []


def test_store_budget_is_507_and_recovers_nothing_partial(limited_server: ServerProcess):
    with httpx.Client(base_url=limited_server.url, timeout=30) as c:
        stored = []
        for _ in range(3):  # 3 x 1000 KiB fits the 3 MiB budget
            data = os.urandom(1000 * 1024)
            assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
            stored.append(data)
        extra = os.urandom(200 * 1024)
        r = c.put(f"/v1/cas/{sha256(extra)}", content=extra)
        assert r.status_code == 507
        assert r.json()["error"]["code"] == "store_full"
        assert c.head(f"/v1/cas/{sha256(extra)}").status_code == 404
        # an existing blob is still accepted (it takes no room) and everything reads back
        assert c.put(f"/v1/cas/{sha256(stored[0])}", content=stored[0]).status_code == 200
        for data in stored:
            assert c.get(f"/v1/cas/{sha256(data)}").content == data
    assert limited_server.temp_files() == []


def test_unknown_blob_is_404(client: httpx.Client):
    missing = sha256(b"never uploaded")
    assert client.head(f"/v1/cas/{missing}").status_code == 404
    r = client.get(f"/v1/cas/{missing}")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "blob_not_found"


def test_head_answers_from_the_index_and_a_lost_blob_heals(server: ServerProcess,
                                                           client: httpx.Client):
    """HEAD trusts the index's record (no store round trip); a blob lost behind the
    server's back is found out by the manifest naming it (424), which drops the record, so
    the next publish's HEAD says 404 and the upload brings it back."""
    data = os.urandom(3000)
    digest = sha256(data)
    assert client.put(f"/v1/cas/{digest}", content=data).status_code == 201
    server.drop_stored(digest)
    head = client.head(f"/v1/cas/{digest}")
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(data)
    assert client.get(f"/v1/cas/{digest}").status_code == 404  # a read asks the store
    m = make_manifest({"megacache": data}, make_fingerprint(code="lost-blob"))
    refused = client.put(f"/v1/ac/{m.key}", content=m.to_json())
    assert refused.status_code == 424 and refused.json()["error"]["missing"] == [digest]
    assert client.head(f"/v1/cas/{digest}").status_code == 404
    assert client.put(f"/v1/cas/{digest}", content=data).status_code == 201
    assert client.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
    assert client.get(f"/v1/cas/{digest}").content == data
