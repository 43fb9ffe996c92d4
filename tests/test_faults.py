"""Faults: crashes, a full disk, storage backends going away.

Each test checks the same promise: nothing partial becomes visible, what was written before
stays intact (`megacache-server fsck` agrees), the service says why it cannot serve, and it
recovers by itself once the fault is gone. The client's side (misbehaving servers, the
breaker, timeouts): test_breaker.py, test_retry.py, test_transport.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args, environment_missing, started
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256

from benchmarks.harness.servers import LocalRedis, LocalSeaweedS3

pytestmark = pytest.mark.e2e  # crashes and outages of real server processes and their storage


def populate(url: str, n: int = 3, size: int = 200_000,
             name: str = "keep") -> list[tuple[bytes, str]]:
    """`n` entries of one fresh blob each (code `{name}{i}`): [(blob, entry key)]."""
    written = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(n):
            data = os.urandom(size)
            assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
            m = make_manifest({"megacache": data}, make_fingerprint(code=f"{name}{i}"))
            assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
            written.append((data, m.key))
    return written


def intact(url: str, written: list[tuple[bytes, str]]) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        for data, key in written:
            assert c.get(f"/v1/ac/{key}").status_code == 200
            assert c.get(f"/v1/cas/{sha256(data)}").content == data


def test_kill_during_upload_then_fsck_is_clean(tmp_path: Path):
    server = ServerProcess(tmp_path / "data").start()
    try:
        written = populate(server.url)
        data = os.urandom(8 * 1024 * 1024)
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(f"PUT /v1/cas/{sha256(data)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
                     f"{len(data)}\r\n\r\n".encode() + data[:3_000_000])
        deadline = time.monotonic() + 10
        while not server.temp_files() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.temp_files(), "the upload never started"  # killed mid-upload, not before
        server.kill()
        sock.close()
        assert server.temp_files()  # the partial upload, on disk but never a blob
        assert sha256(data) not in server.blob_names()
        assert server.cli("fsck").endswith("clean")
        server.start()
        intact(server.url, written)
        assert httpx.head(f"{server.url}/v1/cas/{sha256(data)}").status_code == 404
    finally:
        server.stop()


def _fsck(server: ServerProcess, *flags: str) -> subprocess.CompletedProcess[str]:
    """fsck on the server's storage, its findings' exit code (1) kept, not raised."""
    return subprocess.run([sys.executable, "-m", "megacache_server", "fsck", *flags,
                           *server.extra_args, "--data-dir", str(server.data_dir)],
                          capture_output=True, text=True, env={**os.environ, **server.env})


PAUSED_GC = """
import os, runpy, sys, time
marker, after = sys.argv.pop(1), int(sys.argv.pop(1))
unlink, deleted = os.unlink, []

def unlink_then_pause(path, *args, **kwargs):
    unlink(path, *args, **kwargs)
    if f"{os.sep}cas{os.sep}" in os.fspath(path):
        deleted.append(path)
        if len(deleted) == after:
            open(marker, "w").close()
            time.sleep(600)  # mid-delete until the test kills this process

os.unlink = os.remove = unlink_then_pause
sys.argv[0] = "megacache-server"
runpy.run_module("megacache_server", run_name="__main__", alter_sys=True)
"""
"""`megacache-server <args>` that pauses after deleting `after` blob files and touches
`marker`: the test then knows GC is in the middle of deleting, not before or after it."""


def test_kill_during_gc_then_fsck_repairs(tmp_path: Path):
    """GC killed between evicting entries and deleting their blobs: no entry may point at a
    deleted blob, and fsck repairs what the kill left (records of blobs already gone)."""
    server = ServerProcess(tmp_path / "data").start()
    try:
        kept = populate(server.url)  # pinned below: never evicted
        evictable = populate(server.url, n=40, size=20_000, name="old")
        with httpx.Client(base_url=server.url) as c:
            for _ in range(300):  # unreferenced blobs for GC to delete
                data = os.urandom(2000)
                assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
    finally:
        server.stop()
    for _, key in kept:
        server.cli("pin", key)
    blobs_before = len(server.blob_names())
    assert blobs_before == 3 + 40 + 300
    marker, out = tmp_path / "gc-paused", tmp_path / "gc.out"
    with open(out, "wb") as stdout:  # 2 MB stored, 1 MB budget: about half the old go
        gc = subprocess.Popen(
            [sys.executable, "-c", PAUSED_GC, str(marker), "10", "gc", "--store-budget", "1MB",
             "--data-dir", str(server.data_dir)], stdout=stdout, stderr=subprocess.STDOUT,
            env={**os.environ, "MEGACACHE_GC_GRACE_S": "0", "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and gc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists() and gc.poll() is None, \
            f"GC was not caught deleting (exit {gc.returncode}): {out.read_text()[-500:]}"
        assert len(server.blob_names()) == blobs_before - 10  # mid-delete: 10 gone so far
    finally:
        gc.kill()
        gc.wait()
    assert gc.returncode == -signal.SIGKILL
    plan = out.read_text().splitlines()
    evicted = {line.split()[2] for line in plan if line.startswith("evict entry ")}
    planned = [line for line in plan if line.startswith("delete blob ")]
    assert 0 < len(evicted) < 40 and len(planned) > 300 + 10, plan[:3]
    assert not any(line.startswith("evicted ") for line in plan)  # it never finished
    assert evicted <= {key for _, key in evictable}
    report = _fsck(server)
    assert "dangling" not in report.stdout, report.stdout  # entries go before their blobs
    assert report.returncode == 1, report.stdout + report.stderr  # the kill left work undone
    assert report.stdout.startswith(f"{43 - len(evicted)} entries, "), report.stdout
    assert server.cli("fsck", "--repair", "--verify").splitlines()[-1] == "repaired"
    assert server.cli("fsck").endswith("clean")
    server.start()
    try:
        intact(server.url, kept + [(d, k) for d, k in evictable if k not in evicted])
        for _, key in evictable:
            if key in evicted:
                assert httpx.get(f"{server.url}/v1/ac/{key}").status_code == 404
    finally:
        server.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsck_finds_and_repairs_damage(backend: str, tmp_path: Path,
                                       request: pytest.FixtureRequest):
    args, env = backend_args(backend, request)
    server = _configured(ServerProcess(tmp_path / "data", *args, env=env), backend,
                         args).start()
    written = populate(server.url, n=3)
    server.stop()
    lost = sha256(written[0][0])
    server.drop_stored(lost)  # the store lost a blob
    rotten = sha256(written[1][0])
    server.write_stored(rotten, b"x" + server.read_stored(rotten)[1:])  # another rotted
    orphan = os.urandom(100)  # a blob committed by a process killed before recording it
    server.write_stored(sha256(orphan), orphan)
    fast = _fsck(server)
    assert fast.returncode == 1, fast.stderr
    assert f"dangling entry {written[0][1]}" in fast.stdout
    assert f"stale blob record {lost}" in fast.stdout
    assert f"unrecorded blob {sha256(orphan)}" in fast.stdout
    assert "corrupt blob" not in fast.stdout  # only --verify reads the blobs
    assert "3 entries, 3 blobs" in fast.stdout
    check = _fsck(server, "--verify")
    assert check.returncode == 1
    assert f"corrupt blob {rotten}" in check.stdout
    server.cli("fsck", "--repair", "--verify")
    assert server.cli("fsck", "--verify").endswith("clean")
    assert server.cli("fsck").startswith("1 entries, 2 blobs")  # the intact one and the orphan


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        environment_missing("a tmpfs mount (needs root)", r.stderr.strip())
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_is_507_and_recovers(tmp_path: Path, small_disk: Path):
    server = ServerProcess(small_disk / "data", "--min-free-disk", "0",
                           "--index", f"sqlite:///{tmp_path / 'index.sqlite3'}").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            statuses, kept = [], []
            for _ in range(6):
                data = os.urandom(1500 * 1024)
                r = c.put(f"/v1/cas/{sha256(data)}", content=data)
                statuses.append(r.status_code)
                if r.status_code == 201:
                    kept.append(data)
                else:
                    assert r.status_code == 507, r.text
                    assert r.json()["error"]["code"] == "disk_full"
                    assert c.head(f"/v1/cas/{sha256(data)}").status_code == 404
            assert 507 in statuses and kept
            assert server.temp_files() == []
            subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True)
            data = os.urandom(1500 * 1024)
            assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
            for old in kept:
                assert c.get(f"/v1/cas/{sha256(old)}").content == old
    finally:
        server.stop()


def test_a_store_that_cannot_write_is_not_ready(small_disk: Path):
    server = ServerProcess(small_disk / "data", "--min-free-disk", "1MiB").start()
    filler = small_disk / "filler"
    try:
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=64"],
                       capture_output=True, check=False)  # until the disk is full
        r = httpx.get(f"{server.url}/readyz", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "disk_full", r.text
        filler.unlink()
        assert httpx.get(f"{server.url}/readyz", timeout=30).status_code == 200
    finally:
        server.stop()


def test_redis_down_is_503_with_reason_and_recovers(tmp_path: Path):
    redis = started(LocalRedis(tmp_path / "redis"), "redis-server")
    server = ServerProcess(tmp_path / "data", "--index", redis.url).start()
    try:
        written = populate(server.url, n=1)
        redis.stop()
        r = httpx.get(f"{server.url}/readyz", timeout=30)
        assert r.status_code == 503 and "redis" in r.json()["error"]["message"]
        r = httpx.get(f"{server.url}/v1/ac/{written[0][1]}", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "index_unavailable"
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        redis.start()  # same port, empty: the index is gone, the service is back
        for _ in range(50):
            if httpx.get(f"{server.url}/readyz", timeout=30).status_code == 200:
                break
            time.sleep(0.2)
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        populate(server.url, n=1)
    finally:
        server.stop()
        redis.stop()
    assert "Traceback" not in server.log()


def test_s3_down_is_503_with_reason_and_recovers(tmp_path: Path):
    weed = started(LocalSeaweedS3(tmp_path / "s3"), "SeaweedFS (weed)")
    server = ServerProcess(tmp_path / "data", "--blob-store", "s3", "--s3-endpoint",
                           weed.endpoint, "--s3-bucket", "fault-bucket",
                           env={"MEGACACHE_S3_CREATE_BUCKET": "true",
                                "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}).start()
    try:
        written = populate(server.url, n=1)
        weed.stop()
        r = httpx.get(f"{server.url}/readyz", timeout=60)
        assert r.status_code == 503 and "S3" in r.json()["error"]["message"]
        data = os.urandom(1000)
        r = httpx.put(f"{server.url}/v1/cas/{sha256(data)}", content=data, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        weed.start()  # same port and data dir
        for _ in range(100):
            if httpx.get(f"{server.url}/readyz", timeout=60).status_code == 200:
                break
            time.sleep(0.3)
        intact(server.url, written)
    finally:
        server.stop()
        weed.stop()
