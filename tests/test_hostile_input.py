"""Hostile input that used to get through: each case is one a tenant, a proxy or a server
in front of the client can send, and each test fails without its fix."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest
from helpers import ServerProcess, sha256

BLOB = b"megacache" * 100
DIGEST = hashlib.sha256(BLOB).hexdigest()
HUGE = "9" * 5000


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("hostile") / "data").start()
    yield server
    server.stop()


@pytest.mark.parametrize("header, status, body", [
    (f"bytes={HUGE}-", 416, None),  # starts past any blob
    (f"bytes=0-{HUGE}", 206, BLOB),  # ends past the blob: the whole of it
    (f"bytes=-{HUGE}", 206, BLOB),  # a suffix longer than the blob: all of it
    (f"bytes={'0' * 5000}5-9", 206, BLOB[5:10]),  # leading zeros are still a small number
])
def test_ranges_of_thousands_of_digits_are_answered_not_raised(plain: ServerProcess,
                                                               header: str, status: int,
                                                               body: bytes | None):
    with httpx.Client(base_url=plain.url) as c:
        assert c.put(f"/v1/cas/{DIGEST}", content=BLOB).status_code in (200, 201)
        r = c.get(f"/v1/cas/{DIGEST}", headers={"range": header})
        assert r.status_code == status, (r.status_code, r.text[:200])
        if body is not None:
            assert r.content == body
    assert "Traceback" not in plain.log()


def _wait_for(server: ServerProcess, text: str) -> str:
    import time

    deadline = time.monotonic() + 10
    while text not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)  # access log lines are written after the response
    return server.log()


def _spellings(token: str) -> list[str]:
    """Ways a client can write a token that a plain match misses."""
    every = "".join(f"%{b:02X}" for b in token.encode())
    return [token.replace("_", "%5F"), every, every.replace("%", "%25"),
            token.replace("_", "%5f").replace("mc", "%6D%63")]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_token_reaches_the_logs_however_it_is_spelled(tmp_path, fmt: str):
    from urllib.parse import quote

    from helpers import make_fingerprint, make_manifest

    server = ServerProcess(tmp_path / "data", "--auth", "--log-format", fmt,
                           env={"MEGACACHE_WITHDRAW_AFTER_REPORTS": "1"},
                           log_level="info").start()
    try:
        token = server.token("read,write", name="spy")
        secret = token.split("_", 2)[2]
        auth = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=server.url) as c:
            # an encoded `=`, a token in the path, a token as the request id
            c.get(f"/?x=1&token%3D{token}&mark=encoded")
            c.get(f"/v1/cas/{token}", headers=auth)
            c.get("/v1/stats?mark=rid", headers={**auth, "x-request-id": token})
            # `%5F` for `_`, %-encoded whole (once, twice), an encoded parameter name
            for i, spelled in enumerate(_spellings(token)):
                c.get(f"/v1/cas/{spelled}?n={i}", headers=auth)
                c.get(f"/?x={spelled}&n={i}")
            c.get(f"/?tok%65n={token}&mark=name")
            c.get(f"/?tok%2565n={quote(token, safe='')}&mark=name2")
            # a report's detail, quoted by the warning that withdraws the entry
            data = b"logged" * 100
            assert c.put(f"/v1/cas/{sha256(data)}", content=data, headers=auth).status_code \
                == 201
            m = make_manifest({"megacache": data}, make_fingerprint(model="logged"))
            assert c.put(f"/v1/ac/{m.key}", content=m.to_json(), headers=auth).status_code \
                == 201
            r = c.post(f"/v1/ac/{m.key}/report", headers=auth, json={
                "kind": "load", "detail": f"torch said {token.replace('_', '%5F')} {token}"})
            assert r.json()["verdict"] == "withdrawn", r.text
        log = _wait_for(server, "withdrew entry")
        if fmt == "json":  # the JSON access log names paths, not queries: wait for them all
            import time

            deadline = time.monotonic() + 10
            while server.log().count('"request_id"') < 16 and time.monotonic() < deadline:
                time.sleep(0.1)
            log = server.log()
            assert log.count('"request_id"') >= 16, log[-2000:]
        else:
            log = _wait_for(server, "mark=name2")
            assert "mark=encoded" in log and "mark=name" in log
        assert "withdrew entry" in log, log[-2000:]
        for written in [secret, *_spellings(secret)]:
            assert written not in log, (written, log[-3000:])
    finally:
        server.stop()


# -- a hostile server or proxy in front of the client ------------------------------------

GiB = 1 << 30


@pytest.fixture
def zstd_bomb_server() -> Iterator[str]:
    """Answers every GET with 1 GiB of zeros as ~32 KiB of `Content-Encoding: zstd`."""
    import http.server
    import threading

    import zstandard

    cctx = zstandard.ZstdCompressor(level=19)
    bomb = cctx.compress(b"\0" * (64 << 20))  # one 64 MiB frame, sent 16 times
    body = bomb * 16

    class Bomb(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-encoding", "zstd")
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bomb)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_encoded_answer_is_refused_before_it_is_decoded(zstd_bomb_server: str, tmp_path):
    import resource

    from megacache_client.config import ClientConfig
    from megacache_client.transport.client import RemoteCache, TransportError

    cfg = ClientConfig.from_env({"MEGACACHE_URL": zstd_bomb_server, "MEGACACHE_RETRIES": "0",
                                 "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "node")})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with RemoteCache(cfg) as remote:
        with pytest.raises(TransportError, match="Content-Encoding 'zstd'"):
            remote.get_entry("a" * 64)
        with pytest.raises(TransportError, match="Content-Encoding 'zstd'"):
            remote.download_blob("b" * 64, 2_700, tmp_path / "blob")
    assert not (tmp_path / "blob").exists()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 256 * 1024, f"memory grew by {grown_kib} KiB"


def test_a_frame_that_declares_more_than_the_manifest_is_refused_unread():
    import resource

    import zstandard

    from megacache_client.torch.packs import PackError, decompress_bytes

    data = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * GiB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(PackError, match="declares 1073741824 bytes"):
        decompress_bytes(data, 1_000, None, cap=4096)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024


def _pack(path, members: list[tuple[str, bytes]]):
    import io
    import tarfile

    import zstandard

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


def test_a_pack_of_too_many_members_is_refused(tmp_path):
    from megacache_client.torch.packs import MAX_MEMBERS, PackError, unpack

    pack = _pack(tmp_path / "many", [(f"k{i}.so", b"") for i in range(MAX_MEMBERS + 4000)])
    with pytest.raises(PackError, match=f"more than {MAX_MEMBERS} files"):
        unpack(pack, tmp_path / "out", suffixes=(".so",), cap=10**9)


def test_a_pack_of_too_many_folders_is_refused_before_they_are_made(tmp_path):
    """Members are capped, and so are the folders they lie in: 120,000 empty files each in
    a folder of its own would cost as many inodes and no bytes."""
    from megacache_client.torch.packs import MAX_FOLDERS, PackError, unpack

    pack = _pack(tmp_path / "folders", [(f"d{i}/k.so", b"") for i in range(MAX_FOLDERS + 500)])
    with pytest.raises(PackError, match=f"more than {MAX_FOLDERS} folders"):
        unpack(pack, tmp_path / "out", suffixes=(".so",), cap=10**9)
    made = sum(1 for p in (tmp_path / "out").rglob("*") if p.is_dir())
    assert made <= MAX_FOLDERS


@pytest.mark.parametrize("name", ["/".join(["d"] * 40) + "/k.so", "d/" + "k" * 2000 + ".so"])
def test_a_member_too_deep_or_too_long_is_refused(tmp_path, name: str):
    from megacache_client.torch.packs import PackError, unpack

    pack = _pack(tmp_path / "deep", [(name, b"x")])
    with pytest.raises(PackError, match="deep"):
        unpack(pack, tmp_path / "out", suffixes=(".so",), cap=10**9)
    assert not (tmp_path / "out" / "d").exists()


@pytest.mark.parametrize("names", [["a.so", "a.so/b.so"], ["a.so/b.so", "a.so"],
                                   ["a.so", "a.so"]])
def test_members_that_clash_are_a_pack_error(tmp_path, names: list[str]):
    from megacache_client.torch.packs import PackError, unpack

    pack = _pack(tmp_path / "clash", [(n, b"k") for n in names])
    with pytest.raises(PackError, match="clashes"):
        unpack(pack, tmp_path / "out", suffixes=(".so",), cap=10**6)


def test_a_pack_index_cannot_point_outside_the_pack(tmp_path):
    import json

    from megacache_client.torch import relocate
    from megacache_client.torch.packs import PackError

    outside = tmp_path / "secret.txt"
    outside.write_text("not a kernel")
    ident = "c" * 64
    raw = json.dumps({"format": relocate.INDEX_FORMAT, "build": {},
                      "files": {"../secret.txt": ident}}).encode()
    with pytest.raises(PackError, match="unsafe file name"):
        relocate.parse_index(raw)
    # and a name that resolves outside the unpacked folder never stands in for a kernel
    recorder = relocate.KeyRecorder()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "link").symlink_to(outside)
    recorder.learn(tmp_path / "kernels", {"link": ident})
    assert ident not in recorder.available
