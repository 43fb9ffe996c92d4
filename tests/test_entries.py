"""The index (`/v1/ac`) over a real server: manifests, conditions, listing, bad input."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256

from megacache_client.wire.manifest import component_digest


def _upload(client: httpx.Client, *blobs: bytes) -> None:
    for data in blobs:
        assert client.put(f"/v1/cas/{sha256(data)}", content=data).status_code in (200, 201)


def _put(client: httpx.Client, manifest, **headers: str) -> httpx.Response:
    return client.put(f"/v1/ac/{manifest.key}", content=manifest.to_json(),
                      headers={"content-type": "application/json", **headers})


def test_entry_round_trip_and_replace(client: httpx.Client):
    bundle, kernels = os.urandom(5000), os.urandom(7000)
    _upload(client, bundle, kernels)
    manifest = make_manifest({"megacache": bundle, "kernels": kernels},
                             make_fingerprint(code="round-trip"))
    r = _put(client, manifest)
    assert r.status_code == 201, r.text
    etag = r.headers["etag"]
    got = client.get(f"/v1/ac/{manifest.key}")
    assert got.status_code == 200
    assert got.headers["etag"] == etag
    assert got.json() == json.loads(manifest.to_json())
    assert [b["role"] for b in got.json()["blobs"]] == ["megacache", "kernels"]
    assert client.get(f"/v1/ac/{manifest.key}",
                      headers={"if-none-match": etag}).status_code == 304
    newer = manifest.replace(cold_compile_s=99.0)
    r = _put(client, newer)
    assert r.status_code == 200
    assert r.headers["etag"] != etag
    assert client.get(f"/v1/ac/{manifest.key}").json()["cold_compile_s"] == 99.0


def test_conditional_writes(client: httpx.Client):
    bundle = os.urandom(100)
    _upload(client, bundle)
    m = make_manifest({"megacache": bundle}, make_fingerprint(code="conditional"))
    assert _put(client, m, **{"if-match": "*"}).status_code == 412  # nothing to match yet
    first = _put(client, m, **{"if-none-match": "*"})
    assert first.status_code == 201
    again = _put(client, m, **{"if-none-match": "*"})
    assert again.status_code == 412
    assert again.json()["error"]["code"] == "precondition_failed"
    m2 = m.replace(cold_compile_s=1.0)
    assert _put(client, m2, **{"if-match": '"stale"'}).status_code == 412
    ok = _put(client, m2, **{"if-match": first.headers["etag"]})
    assert ok.status_code == 200
    # the writer holding the old etag cannot overwrite the newer entry
    m3 = m.replace(cold_compile_s=2.0)
    assert _put(client, m3, **{"if-match": first.headers["etag"]}).status_code == 412
    assert client.get(f"/v1/ac/{m.key}").json()["cold_compile_s"] == 1.0


def test_concurrent_writes_of_one_key(server: ServerProcess, client: httpx.Client):
    bundle = os.urandom(2048)
    _upload(client, bundle)
    fp = make_fingerprint(code="concurrent")
    manifests = [make_manifest({"megacache": bundle}, fp, cold_compile_s=float(i))
                 for i in range(20)]

    def write(args: tuple[int, dict[str, str]]) -> int:
        i, headers = args
        with httpx.Client(base_url=server.url, timeout=30) as c:
            return _put(c, manifests[i], **headers).status_code

    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(write, [(i, {}) for i in range(20)]))
    assert sorted(codes) == [200] * 19 + [201]
    final = client.get(f"/v1/ac/{fp.key()}").json()
    assert final in [json.loads(m.to_json()) for m in manifests]

    # create-only writers racing: exactly one wins
    fp2 = make_fingerprint(code="concurrent-create")
    manifests = [make_manifest({"megacache": bundle}, fp2, cold_compile_s=float(i))
                 for i in range(20)]
    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(write, [(i, {"if-none-match": "*"}) for i in range(20)]))
    assert sorted(codes) == [201] + [412] * 19
    assert server.temp_files() == []


def test_list_newest_first_with_filters(client: httpx.Client):
    bundle = os.urandom(300)
    _upload(client, bundle)
    now = datetime.now(timezone.utc)
    hw_other = {"arch": "aarch64", "isa": "neon", "cxx": "g++ 12.2.0"}
    written = []
    for i in range(4):
        fp = make_fingerprint(model="listed", code=f"v{i}",
                              **({"hw": hw_other} if i == 3 else {}))
        m = make_manifest({"megacache": bundle}, fp, created_at=now - timedelta(hours=10 - i))
        assert _put(client, m).status_code == 201
        written.append(m)
    r = client.get("/v1/ac", params={"model": "listed"})
    assert [e["key"] for e in r.json()["entries"]] == [m.key for m in reversed(written)]
    same_hw = component_digest(written[0].fingerprint.hw)
    r = client.get("/v1/ac", params={"model": "listed", "hw": same_hw, "limit": 2})
    assert [e["fingerprint"]["code"] for e in r.json()["entries"]] == ["v2", "v1"]
    env = component_digest(written[0].fingerprint.env)
    r = client.get("/v1/ac", params={"model": "listed", "env": env,
                                     "hw": component_digest(hw_other)})
    assert [e["fingerprint"]["code"] for e in r.json()["entries"]] == ["v3"]
    assert client.get("/v1/ac", params={"model": "nobody"}).json() == {"entries": []}
    assert client.get("/v1/ac", params={"limit": 0}).status_code == 422
    assert client.get("/v1/ac", params={"hw": "../x"}).status_code == 400


def test_an_entry_from_the_future_is_not_the_newest_forever(client: httpx.Client):
    """Listings and fallbacks order by when an entry was made, clamped to the server's
    clock: a manifest dated 9999 written first is older than one written after it."""
    bundle = os.urandom(400)
    _upload(client, bundle)
    future = make_manifest({"megacache": bundle}, make_fingerprint(model="dated", code="f"),
                           created_at=datetime(9999, 1, 1, tzinfo=timezone.utc))
    assert _put(client, future).status_code == 201
    later = make_manifest({"megacache": bundle}, make_fingerprint(model="dated", code="l"))
    assert _put(client, later).status_code == 201
    listed = client.get("/v1/ac", params={"model": "dated"}).json()["entries"]
    assert [e["key"] for e in listed] == [later.key, future.key]
    assert listed[1]["created_at"].startswith("9999")  # the bytes stay as written
    fp = later.fingerprint
    r = client.post(f"/v1/ac/{make_fingerprint(model='dated', code='x').key()}/resolve",
                    json={"job": "dated", "fallback": {
                        "namespace": fp.namespace, "model": "dated",
                        "env": component_digest(fp.env), "hw": component_digest(fp.hw)}})
    assert r.status_code == 200 and r.json()["key"] == later.key, r.text


def test_delete(client: httpx.Client):
    bundle = os.urandom(10)
    _upload(client, bundle)
    m = make_manifest({"megacache": bundle}, make_fingerprint(code="deleted"))
    _put(client, m)
    assert client.delete(f"/v1/ac/{m.key}").status_code == 204
    assert client.get(f"/v1/ac/{m.key}").status_code == 404
    assert client.delete(f"/v1/ac/{m.key}").status_code == 404
    # the blob stays until garbage collection
    assert client.head(f"/v1/cas/{sha256(bundle)}").status_code == 200


def test_entry_naming_a_missing_blob_is_424_and_not_written(client: httpx.Client):
    present, absent = os.urandom(64), os.urandom(64)
    _upload(client, present)
    m = make_manifest({"megacache": present, "kernels": absent},
                      make_fingerprint(code="dangling"))
    r = _put(client, m)
    assert r.status_code == 424
    assert r.json()["error"]["missing"] == [sha256(absent)]
    assert client.get(f"/v1/ac/{m.key}").status_code == 404


def test_blob_size_mismatch_is_422(client: httpx.Client):
    data = os.urandom(64)
    _upload(client, data)
    m = make_manifest({"megacache": data}, make_fingerprint(code="size-lie"))
    body = json.loads(m.to_json())
    body["blobs"][0]["size"] = 65
    r = client.put(f"/v1/ac/{m.key}", json=body)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "size_mismatch"
    assert client.get(f"/v1/ac/{m.key}").status_code == 404


def _valid_body(client: httpx.Client) -> tuple[str, dict]:
    data = os.urandom(32)
    _upload(client, data)
    m = make_manifest({"megacache": data}, make_fingerprint(code="bad-input"))
    return m.key, json.loads(m.to_json())


@pytest.mark.parametrize("mutate, code", [
    (lambda b: b.update(surprise=1), "invalid_manifest"),                      # unknown field
    (lambda b: b["blobs"][0].update(size=-1), "invalid_manifest"),             # negative size
    (lambda b: b["blobs"][0].update(digest="../../etc"), "invalid_manifest"),  # bad digest
    (lambda b: b.update(blobs=[]), "invalid_manifest"),                        # no blob
    (lambda b: b.pop("torch_version"), "invalid_manifest"),                    # missing field
    (lambda b: b.update(format=2), "invalid_manifest"),                        # unknown format
    (lambda b: b.update(cold_compile_s="fast"), "invalid_manifest"),           # wrong type
    (lambda b: b["fingerprint"].update(code="other"), "invalid_manifest"),     # key != fingerprint
    (lambda b: b["blobs"][0].update(role="Bad Role!"), "invalid_manifest"),
])
def test_malformed_manifest_is_422(client: httpx.Client, mutate, code):
    key, body = _valid_body(client)
    mutate(body)
    r = client.put(f"/v1/ac/{key}", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["errors"]
    assert client.get(f"/v1/ac/{key}").status_code == 404


def test_a_large_manifest_is_validated_as_a_small_one(client: httpx.Client):
    """Over 16 KiB a manifest is validated in a worker thread (not on the event loop):
    same answers, a valid one stored byte for byte, a bad value found where it is."""
    data = os.urandom(32)
    _upload(client, data)
    big = {f"var{i}": f"value-{i}-" + "v" * 240 for i in range(64)}  # each at its cap
    m = make_manifest({"megacache": data}, make_fingerprint(code="large", env=big, hw=big,
                                                            config=big))
    assert len(m.to_json()) > 32 * 1024
    assert _put(client, m).status_code == 201
    assert client.get(f"/v1/ac/{m.key}").content == m.to_json()
    body = json.loads(m.to_json())
    body["fingerprint"]["env"]["var40"] = 1e400  # JSON's way to spell infinity
    r = client.put(f"/v1/ac/{m.key}", content=json.dumps(body).replace("Infinity", "1e400"))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["errors"][0]["loc"] == ["fingerprint", "env", "var40"]


def test_not_json_is_422(client: httpx.Client):
    key, _ = _valid_body(client)
    for body in (b"{not json", b"\xff\xfe", b"", b"[]"):
        r = client.put(f"/v1/ac/{key}", content=body)
        assert r.status_code == 422, body
        assert client.get(f"/v1/ac/{key}").status_code == 404


def test_manifest_for_another_key_is_422(client: httpx.Client):
    key, body = _valid_body(client)
    other = sha256(b"other key")
    r = client.put(f"/v1/ac/{other}", json=body)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "key_mismatch"
    assert client.get(f"/v1/ac/{other}").status_code == 404


@pytest.mark.parametrize("bad", ["abc", "Z" * 64, "0" * 65, "..%2F..%2Fetc"])
def test_malformed_key_is_refused(client: httpx.Client, bad: str):
    for method in ("GET", "PUT", "DELETE"):
        r = client.request(method, f"/v1/ac/{bad}", content=b"{}" if method == "PUT" else None)
        assert r.status_code in (400, 404), (method, r.status_code)
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "malformed_key"


def test_oversize_manifest_is_413(limited_server: ServerProcess):
    with httpx.Client(base_url=limited_server.url) as c:
        data = os.urandom(16)
        _upload(c, data)
        m = make_manifest({"megacache": data}, make_fingerprint(code="big"))
        body = json.loads(m.to_json())
        body["producer"] = {f"k{i}": "v" * 200 for i in range(20)}
        r = c.put(f"/v1/ac/{m.key}", json=body)
        assert r.status_code == 413
        assert c.get(f"/v1/ac/{m.key}").status_code == 404


def test_unknown_entry_is_404(client: httpx.Client):
    r = client.get(f"/v1/ac/{sha256(b'no such key')}")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "entry_not_found"
