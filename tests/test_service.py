"""The service as an operator sees it: settings, health, docs, restarts and crashes (its
command line: test_server_cli.py)."""

from __future__ import annotations

import os
import shutil
import time

import httpx
from helpers import ServerProcess, make_fingerprint, make_manifest, raw_http, sha256


def test_everything_written_survives_restart_and_kill(tmp_path):
    server = ServerProcess(tmp_path / "data", "--workers", "2").start()
    blobs = [os.urandom(n) for n in (10, 100_000, 3_000_000)]
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for data in blobs:
                assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
            manifest = make_manifest({"megacache": blobs[0], "kernels": blobs[2]},
                                     make_fingerprint(code="durable"))
            assert c.put(f"/v1/ac/{manifest.key}", content=manifest.to_json()).status_code == 201
        server.stop()  # graceful
        server.start()
        _assert_intact(server, blobs, manifest)
        server.kill()  # SIGKILL: committed data must be on disk already
        server.start()
        _assert_intact(server, blobs, manifest)
    finally:
        server.stop()
    assert "Traceback" not in server.log()


def _assert_intact(server: ServerProcess, blobs: list[bytes], manifest) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for data in blobs:
            assert c.get(f"/v1/cas/{sha256(data)}").content == data
        got = c.get(f"/v1/ac/{manifest.key}")
        assert got.status_code == 200
        assert got.json()["blobs"] == [b.to_dict() for b in manifest.blobs]
        assert [e["key"] for e in c.get("/v1/ac", params={"model": "mlp"}).json()["entries"]] \
            == [manifest.key]


def test_kill_during_upload_leaves_no_partial_blob(tmp_path):
    server = ServerProcess(tmp_path / "data").start()
    data = os.urandom(4 * 1024 * 1024)
    digest = sha256(data)
    try:
        import socket
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(f"PUT /v1/cas/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data[:1_500_000])
        for _ in range(100):  # wait until the upload is in flight
            if server.temp_files():
                break
            time.sleep(0.05)
        assert server.temp_files(), "upload never started"
        server.kill()
        sock.close()
        server.start()
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.head(f"/v1/cas/{digest}").status_code == 404
            assert digest not in server.blob_names()
            assert c.put(f"/v1/cas/{digest}", content=data).status_code == 201
            assert c.get(f"/v1/cas/{digest}").content == data
    finally:
        server.stop()


def test_health_ready_and_docs(server: ServerProcess, client: httpx.Client):
    assert client.get("/healthz").json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200
    index, blobs = server.backend.split("+")
    assert ready.json() == {"status": "ready", "blobs": blobs, "index": index}
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    for path in ("/v1/cas/{digest}", "/v1/ac/{key}", "/v1/ac", "/healthz", "/readyz"):
        assert path in spec["paths"], path
    assert "requestBody" in spec["paths"]["/v1/ac/{key}"]["put"]


def test_readyz_reports_broken_storage(tmp_path):
    server = ServerProcess(tmp_path / "data").start()
    try:
        cas = server.data_dir / "cas"
        shutil.move(cas, tmp_path / "moved")
        r = httpx.get(server.url + "/readyz")
        assert r.status_code == 503
        assert "not writable" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/healthz").status_code == 200
        shutil.move(tmp_path / "moved", cas)
        assert httpx.get(server.url + "/readyz").status_code == 200
    finally:
        server.stop()


def test_settings_from_environment(tmp_path):
    server = ServerProcess(tmp_path / "from-env", env={
        "MEGACACHE_DATA_DIR": str(tmp_path / "from-env"),
        "MEGACACHE_MAX_BLOB_SIZE": "1KiB",
    }).start()
    try:
        status, _ = raw_http(server.port, b"PUT /v1/cas/" + b"0" * 64 +
                             b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2048\r\n\r\n")
        assert status == 413
        assert (tmp_path / "from-env" / "index.sqlite3").exists()
    finally:
        server.stop()
