"""Ed25519 manifest signatures: a signed manifest cannot be replayed for
another key or namespace, a verifier cannot sign, and fallback picks are checked too.

A real server signs; a real HTTP proxy between client and server plays the man in the
middle that answers a lookup of one key with the (validly signed) response of another.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import (
    ForwardingProxy,
    ServerProcess,
    make_fingerprint,
    make_manifest,
    sha256,
)

from megacache_client.config import ClientConfig, ConfigError
from megacache_client.lifecycle import Session
from megacache_client.transport.client import RemoteCache, UntrustedEntryError
from megacache_client.wire import headers
from megacache_client.wire.signing import (
    Signer,
    signature_valid,
)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "megacache_server", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A key pair made by the CLI: the private key file and the public key it printed."""
    path = tmp_path_factory.mktemp("keys") / "signing.pem"
    out = cli("signing-key", "generate", "--out", str(path))
    assert out.returncode == 0, out.stderr
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    return path, out.stdout.strip()


@pytest.fixture(scope="module")
def signing(keys: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("signing") / "data",
                           env={"MEGACACHE_SIGNING_KEY_FILE": str(keys[0])}).start()
    yield server
    server.stop()
    assert "Traceback" not in server.log()


def publish(server: ServerProcess, code: str, namespace: str = "default",
            signed: bool = True, **fp: object) -> str:
    data = os.urandom(64)
    m = make_manifest({"megacache": data}, make_fingerprint(code=code, namespace=namespace,
                                                            **fp))
    with httpx.Client(base_url=server.url) as c:
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        r = c.put(f"/v1/ac/{m.key}", content=m.to_json())
        assert r.status_code == 201
        assert r.headers.get(headers.SIGNATURE, "").startswith("ed25519=") == signed
    return m.key


def test_key_generation_cli(keys: tuple[Path, str]):
    path, public = keys
    assert public.startswith("ed25519:")
    shown = cli("signing-key", "public", str(path))
    assert (shown.returncode, shown.stdout.strip()) == (0, public)
    again = cli("signing-key", "generate", "--out", str(path))  # never overwrites a key
    assert again.returncode == 1 and "exists" in again.stderr
    bad = path.parent / "not-a-key.pem"
    bad.write_text("nope")
    assert cli("signing-key", "public", str(bad)).returncode == 1


def test_signed_entry_verifies_with_the_public_key_only(signing: ServerProcess,
                                                         keys: tuple[Path, str]):
    key = publish(signing, "signed")
    with RemoteCache(ClientConfig(url=signing.url, verify_key=keys[1])) as remote:
        got = remote.get_entry(key)
        assert got is not None and got.key == key
    # the public key of another pair does not verify
    stranger = Signer.from_file(_new_key(keys[0].parent / "other.pem")).public_key
    with RemoteCache(ClientConfig(url=signing.url, verify_key=stranger)) as remote, \
            pytest.raises(UntrustedEntryError, match="no valid signature"):
        remote.get_entry(key)


def test_signature_covers_key_and_namespace(signing: ServerProcess, keys: tuple[Path, str]):
    key = publish(signing, "bound", namespace="team-a")
    r = httpx.get(f"{signing.url}/v1/ac/{key}")
    sig = r.headers[headers.SIGNATURE]
    assert signature_valid(keys[1], key, "team-a", r.content, sig)
    assert not signature_valid(keys[1], key, "team-b", r.content, sig)
    assert not signature_valid(keys[1], "0" * 64, "team-a", r.content, sig)
    assert not signature_valid(keys[1], key, "team-a", r.content + b" ", sig)
    # a client of another namespace refuses it even when served under the right key
    with RemoteCache(ClientConfig(url=signing.url, verify_key=keys[1],
                                  namespace="team-b")) as remote, \
            pytest.raises(UntrustedEntryError):
        remote.get_entry(key)


def test_replayed_manifest_of_another_key_is_refused(signing: ServerProcess,
                                                     keys: tuple[Path, str]):
    asked, other = publish(signing, "asked"), publish(signing, "other")
    proxy = ForwardingProxy(signing.url, lambda path: path.replace(asked, other))
    try:
        for verify_key in (keys[1], None):  # the key check holds without signatures too
            with RemoteCache(ClientConfig(url=proxy.url, verify_key=verify_key)) as remote, \
                    pytest.raises(UntrustedEntryError):
                remote.get_entry(asked)
    finally:
        proxy.close()


def test_fallback_pick_is_fetched_verified_and_checked(signing: ServerProcess,
                                                       keys: tuple[Path, str]):
    """An exact miss nominates the newest compatible entry from the listing; the proxy
    answers the nominee's lookup with another entry's signed manifest: invalid, cold."""
    nominee = publish(signing, "v1", model="fallback-model")
    decoy = publish(signing, "decoy", model="decoy-model")
    proxy = ForwardingProxy(signing.url, lambda path: path.replace(nominee, decoy))
    try:
        fp = make_fingerprint(model="fallback-model", code="v2")  # exact key: absent
        session = Session(ClientConfig(url=proxy.url, verify_key=keys[1]), fingerprint=fp)
        result = session.load()
        assert result.outcome == "invalid", result.reason
        assert result.entry is None and "refusing" in result.reason
    finally:
        proxy.close()


def test_unsigned_server_is_refused_by_a_verifying_client(tmp_path: Path,
                                                          keys: tuple[Path, str]):
    server = ServerProcess(tmp_path / "data").start()
    try:
        key = publish(server, "unsigned", signed=False)
        with RemoteCache(ClientConfig(url=server.url, verify_key=keys[1])) as remote, \
                pytest.raises(UntrustedEntryError, match="no valid signature"):
            remote.get_entry(key)
    finally:
        server.stop()


def test_bad_keys_are_clear_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="VERIFY_KEY"):
        ClientConfig(url="http://127.0.0.1:1", verify_key="s3cret").validated()
    with pytest.raises(ConfigError, match="32 bytes"):
        ClientConfig(url="http://127.0.0.1:1", verify_key="ed25519:AAAA").validated()
    # the old HMAC secret is refused at start-up rather than silently not signing
    server = ServerProcess(tmp_path / "data", env={"MEGACACHE_SIGNING_KEY": "s3cret"})
    with pytest.raises(RuntimeError, match="no longer used"):
        server.start(timeout=20)


def _new_key(path: Path) -> Path:
    out = cli("signing-key", "generate", "--out", str(path))
    assert out.returncode == 0, out.stderr
    return path


def test_the_provenance_signature_covers_who_wrote_the_entry(signing: ServerProcess,
                                                            keys: tuple[Path, str]):
    data = os.urandom(64)
    m = make_manifest({"megacache": data}, make_fingerprint(code="prov-signed",
                                                            namespace="team-a"))
    with httpx.Client(base_url=signing.url) as c:
        c.put(f"/v1/cas/{sha256(data)}", content=data)
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json(),
                     headers={"x-megacache-job": "ci-7"}).status_code == 201
        r = c.get(f"/v1/ac/{m.key}")
        resolved = c.post(f"/v1/ac/{m.key}/resolve", json={"job": "j"})
    assert '"job":"ci-7"' in r.headers[headers.PROVENANCE]
    # a resolve answer is the version's provenance naming the attempt it was pinned for
    assert json.loads(resolved.headers[headers.PROVENANCE]) == json.loads(
        r.headers[headers.PROVENANCE]) | {"resolved_for": {"job": "j", "attempt": 0}}
    for answer in (r, resolved):
        provenance = answer.headers[headers.PROVENANCE]
        sig = answer.headers[headers.PROVENANCE_SIGNATURE]
        assert signature_valid(keys[1], m.key, "team-a", answer.content, sig, provenance)
        forged = provenance.replace('"job":"ci-7"', '"job":"ci-8"')
        assert not signature_valid(keys[1], m.key, "team-a", answer.content, sig, forged)
        assert not signature_valid(keys[1], m.key, "team-a", answer.content, sig)
        # the manifest-only signature still verifies as it always did
        assert signature_valid(keys[1], m.key, "team-a", answer.content,
                               answer.headers[headers.SIGNATURE])
    # the client checks both signatures of an entry served with its provenance
    with RemoteCache(ClientConfig(url=signing.url, namespace="team-a",
                                  verify_key=keys[1])) as remote:
        got = remote.get_entry(m.key)
        assert got is not None and got.key == m.key


class _Replay:
    """A proxy that answers every request with one answer it kept from the server."""

    def __init__(self, kept: httpx.Response) -> None:
        keep = {k: v for k, v in kept.headers.items()
                if k.lower() not in ("content-length", "connection", "transfer-encoding")}

        class Answer(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(kept.status_code)
                for k, v in keep.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(kept.content)))
                self.end_headers()
                self.wfile.write(kept.content)

            def log_message(self, *_: object) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()


def test_a_superseded_signed_manifest_replayed_by_a_proxy_is_refused(
        signing: ServerProcess, keys: tuple[Path, str], tmp_path: Path):
    """A rollback: the proxy kept version 1's answer (validly signed, provenance and all)
    and serves it after version 2 is out. A node that has seen version 2 refuses it."""
    data = os.urandom(64)
    m = make_manifest({"megacache": data}, make_fingerprint(code="rollback"))
    with httpx.Client(base_url=signing.url) as c:
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
        v1 = c.get(f"/v1/ac/{m.key}")
        assert c.put(f"/v1/ac/{m.key}", content=m.replace(cold_compile_s=13.0).to_json(),
                     headers={"if-match": v1.headers["etag"]}).status_code == 200
    config = ClientConfig(url=signing.url, verify_key=keys[1], node_cache_dir=tmp_path / "a")
    with RemoteCache(config) as remote:
        seen = remote.get_entry(m.key)
        assert seen is not None and seen.manifest.cold_compile_s == 13.0
    proxy = _Replay(v1)
    try:
        with RemoteCache(dataclasses.replace(config, url=proxy.url)) as remote, \
                pytest.raises(UntrustedEntryError, match="older than version"):
            remote.get_entry(m.key)
        # a node that never saw version 2 cannot tell: version 1 verifies there
        fresh = dataclasses.replace(config, url=proxy.url, node_cache_dir=tmp_path / "b")
        with RemoteCache(fresh) as remote:
            old = remote.get_entry(m.key)
            assert old is not None and old.manifest.cold_compile_s == m.cold_compile_s
    finally:
        proxy.close()
