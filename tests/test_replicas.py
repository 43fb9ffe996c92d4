"""Several stateless replicas sharing one Redis index and one S3 bucket."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import _configured, backend_args
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256

pytestmark = pytest.mark.e2e  # several server processes sharing one Redis and one S3


@pytest.fixture
def replicas(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[list[ServerProcess]]:
    args, env = backend_args("redis+s3", request)
    procs = [_configured(ServerProcess(tmp_path_factory.mktemp(f"replica{i}") / "data", *args,
                                       env=env), "redis+s3", args).start() for i in range(3)]
    yield procs
    for p in procs:
        p.stop()


def test_write_through_one_read_through_the_others(replicas):
    data = os.urandom(20 * 1024 * 1024)  # multipart on S3
    m = make_manifest({"megacache": data}, make_fingerprint(code="replicated"))
    with httpx.Client(base_url=replicas[0].url, timeout=60) as c:
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
    for replica in replicas[1:]:
        with httpx.Client(base_url=replica.url, timeout=60) as c:
            assert c.get(f"/v1/ac/{m.key}").json()["key"] == m.key
            assert c.get(f"/v1/cas/{sha256(data)}").content == data
            r = c.get(f"/v1/cas/{sha256(data)}", headers={"range": "bytes=-10"})
            assert (r.status_code, r.content) == (206, data[-10:])
            assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 200


def test_concurrent_writers_of_one_key_across_replicas(replicas):
    bundle = os.urandom(4096)
    with httpx.Client(base_url=replicas[0].url) as c:
        c.put(f"/v1/cas/{sha256(bundle)}", content=bundle)
    fp = make_fingerprint(code="raced")
    manifests = [make_manifest({"megacache": bundle}, fp, cold_compile_s=float(i))
                 for i in range(20)]

    def write(i: int) -> int:
        with httpx.Client(base_url=replicas[i % 3].url, timeout=30) as c:
            return c.put(f"/v1/ac/{fp.key()}", content=manifests[i].to_json(),
                         headers={"if-none-match": "*"}).status_code

    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(write, range(20)))
    assert sorted(codes) == [201] + [412] * 19
    seen = {httpx.get(f"{r.url}/v1/ac/{fp.key()}").json()["cold_compile_s"] for r in replicas}
    assert len(seen) == 1  # every replica sees the one winner


def test_killed_replica_leaves_nothing_partial(replicas):
    data = os.urandom(40 * 1024 * 1024)
    digest = sha256(data)
    victim, survivors = replicas[0], replicas[1:]
    sock = socket.create_connection(("127.0.0.1", victim.port))
    sock.sendall(f"PUT /v1/cas/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data[:24 * 1024 * 1024])
    deadline = time.monotonic() + 30
    while not victim.temp_files() and time.monotonic() < deadline:
        time.sleep(0.05)  # a multipart upload is under way
    assert victim.temp_files(), "the upload never reached the store"
    victim.kill()
    sock.close()
    m = make_manifest({"megacache": data}, make_fingerprint(code="after-kill"))
    for replica in survivors:
        with httpx.Client(base_url=replica.url, timeout=60) as c:
            assert c.get("/readyz").status_code == 200
            assert c.head(f"/v1/cas/{digest}").status_code == 404
            assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 424
    assert digest not in survivors[0].blob_names()
    with httpx.Client(base_url=survivors[0].url, timeout=60) as c:
        assert c.put(f"/v1/cas/{digest}", content=data).status_code == 201  # the retry
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
    with httpx.Client(base_url=survivors[1].url, timeout=60) as c:
        assert c.get(f"/v1/cas/{digest}").content == data


def test_presigned_redirect_lets_reads_bypass_the_server(request, tmp_path):
    """The 307 announces the store's origin, signed with the server's key: a verifying
    client follows it (the store is on another port of this host, which nothing else may
    send it to); without the key, the announcement counts for public addresses only."""
    from megacache_client.wire import headers
    from megacache_client.wire.signing import Signer, generate_private_key_pem

    key_file = tmp_path / "signing.pem"
    key_file.write_bytes(generate_private_key_pem())
    key_file.chmod(0o600)
    args, env = backend_args("redis+s3", request)
    server = _configured(ServerProcess(tmp_path / "data", *args, "--s3-redirect",
                                       env={**env, "MEGACACHE_SIGNING_KEY_FILE": str(key_file)}),
                         "redis+s3", args).start()
    try:
        data = os.urandom(3 * 1024 * 1024)
        digest = sha256(data)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.put(f"/v1/cas/{digest}", content=data).status_code == 201
            r = c.get(f"/v1/cas/{digest}")
            assert r.status_code == 307
            assert r.headers["location"].startswith(server.s3_endpoint)
            assert r.headers[headers.BLOB_ORIGIN] == server.s3_endpoint
            assert r.headers[headers.BLOB_ORIGIN_SIGNATURE].startswith("ed25519=")
        from megacache_client.config import ClientConfig
        from megacache_client.transport.client import RemoteCache
        from megacache_client.transport.redirects import RedirectRefused

        verify_key = Signer.from_file(key_file).public_key
        with RemoteCache(ClientConfig(url=server.url, verify_key=verify_key)) as remote:
            remote.download_blob(digest, len(data), tmp_path / "got")  # follows, verifies
        assert (tmp_path / "got").read_bytes() == data
        with RemoteCache(ClientConfig(url=server.url)) as remote, \
                pytest.raises(RedirectRefused, match="loopback address announced without"):
            remote.download_blob(digest, len(data), tmp_path / "again")
    finally:
        server.stop()
