"""Blob redirects are followed only where the server vouches, and nothing of a foreign
answer goes back out (issue 47).

A proxy between the trainer and a real (signing) server forwards everything, validly
signed manifests included, but answers blob reads itself with a redirect: to another port
of this host, to the metadata service's link-local address, or to an origin the server
announced (signed with the server's key). The first two are refused before any connection
is made (an audit hook sees every socket the process connects); the third is followed,
without the bearer token. When the announced store answers badly, the event and the report
the trainer sends back say so in the client's words: status, step, host, never the size,
hash or body of what came.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ForwardingProxy, ServerProcess, make_fingerprint, make_manifest, sha256
from hostile_peer import hostile

from megacache_client.config import ClientConfig
from megacache_client.lifecycle import Session
from megacache_client.transport.client import RemoteCache
from megacache_client.transport.redirects import RedirectRefused, address_class
from megacache_client.wire import headers
from megacache_client.wire.signing import (
    Signer,
    blob_origin,
    generate_private_key_pem,
    origin_message,
)

METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"

_connected: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect" and _connected is not None:
        address = args[1]
        _connected.append(str(address[0]) if isinstance(address, tuple) else str(address))


sys.addaudithook(_audit)


@contextlib.contextmanager
def connections() -> Iterator[list[str]]:
    """The host of every socket this process connects inside (any thread)."""
    global _connected
    _connected = []
    try:
        yield _connected
    finally:
        _connected = None


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Signer, str, Path]:
    path = tmp_path_factory.mktemp("keys") / "signing.pem"
    path.write_bytes(generate_private_key_pem())
    path.chmod(0o600)
    signer = Signer.from_file(path)
    return signer, signer.public_key, path


@pytest.fixture(scope="module")
def signing(keys: tuple[Signer, str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("redirects") / "data",
                           env={"MEGACACHE_SIGNING_KEY_FILE": str(keys[2])}).start()
    yield server
    server.stop()
    assert "Traceback" not in server.log()


@pytest.fixture(scope="module")
def entry(signing: ServerProcess) -> tuple[Any, str, bytes]:
    """A published entry (fingerprint, blob digest, blob bytes) of the real server."""
    data = os.urandom(4096)
    fp = make_fingerprint(model="redirected")
    m = make_manifest({"megacache": data}, fp)
    with httpx.Client(base_url=signing.url) as c:
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
    return fp, sha256(data), data


def _redirecting(upstream: str, location: str, announce: dict[str, str] | None = None
                 ) -> ForwardingProxy:
    """A proxy to `upstream` that answers blob reads with a 302 to `location` + the path."""
    def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes] | None:
        if method == "GET" and path.startswith("/v1/cas/"):
            return 302, {"location": location + path, **(announce or {})}, b""
        return None
    return ForwardingProxy(upstream, answer=answer)


def _announce(signer: Signer | None, url: str) -> dict[str, str]:
    """What the server announces with a redirect to `url` (signed when `signer`)."""
    origin = blob_origin(url)
    found = {headers.BLOB_ORIGIN: origin}
    if signer is not None:
        found[headers.BLOB_ORIGIN_SIGNATURE] = signer.sign_message(origin_message(origin))
    return found


def _load(url: str, verify_key: str, fp: Any, tmp: Path, **config: Any) -> Session:
    session = Session(ClientConfig(url=url, verify_key=verify_key, prefetch=False,
                                   node_cache_dir=tmp / "node", load_deadline_s=5,
                                   **config).validated(), fingerprint=fp).start()
    session.load()
    return session


def test_a_redirect_to_another_port_of_this_host_is_refused(
        signing: ServerProcess, keys: tuple[Signer, str, Path],
        entry: tuple[Any, str, bytes], tmp_path: Path) -> None:
    with hostile("silent") as elsewhere, \
            _redirecting(signing.url, elsewhere.url) as proxy:
        session = _load(proxy.url, keys[1], entry[0], tmp_path)
        result = session.load_result
        session.retire()
        elsewhere.settle()
        assert elsewhere.requests == []  # never connected: refused before
    assert result.outcome == "error"
    assert "refused a redirect to 127.0.0.1" in result.reason, result.reason


@pytest.mark.parametrize("announced", ["none", "unsigned", "signed"])
def test_a_redirect_to_the_metadata_service_is_refused_before_connecting(
        announced: str, signing: ServerProcess, keys: tuple[Signer, str, Path],
        entry: tuple[Any, str, bytes], tmp_path: Path) -> None:
    """Even announced and signed (a server's key can be stolen; a metadata service is
    never a blob store): only MEGACACHE_REDIRECT_ORIGINS reaches a link-local address."""
    announce = {} if announced == "none" else _announce(
        keys[0] if announced == "signed" else None, METADATA)
    with _redirecting(signing.url, METADATA, announce) as proxy, connections() as made:
        session = _load(proxy.url, keys[1], entry[0], tmp_path)
        result = session.load_result
        session.retire()
    assert result.outcome == "error" and "refused a redirect" in result.reason, result.reason
    assert made and set(made) == {"127.0.0.1"}, made


def test_an_announced_origin_is_followed_without_the_token(
        signing: ServerProcess, keys: tuple[Signer, str, Path],
        entry: tuple[Any, str, bytes], tmp_path: Path) -> None:
    """The store the server announced (here: another proxy to the server, on another port
    of this host) is followed when the announcement carries the server's signature; the
    same announcement unsigned is refused by a client that verifies."""
    _, digest, data = entry
    with ForwardingProxy(signing.url) as store:
        for signer, followed in ((keys[0], True), (None, False)):
            with _redirecting(signing.url, store.url, _announce(signer, store.url)) as proxy, \
                    RemoteCache(ClientConfig(url=proxy.url, token="mc_secret-token",
                                             verify_key=keys[1])) as remote:
                store.seen.clear()
                store.headers.clear()
                if followed:
                    assert remote.download_blob(digest, len(data), tmp_path / "got") == digest
                    assert (tmp_path / "got").read_bytes() == data
                else:
                    with pytest.raises(RedirectRefused, match="without the server's signature"):
                        remote.download_blob(digest, len(data), tmp_path / "got")
                # the server's own origin got the token; the store it sent us to did not
                assert proxy.headers[-1].get("authorization") == "Bearer mc_secret-token"
            assert [p for _, p, _ in store.seen] == ([f"/v1/cas/{digest}"] if followed else [])
            assert all("authorization" not in h for h in store.headers), store.headers


def test_a_configured_origin_is_followed_unannounced(
        signing: ServerProcess, keys: tuple[Signer, str, Path],
        entry: tuple[Any, str, bytes], tmp_path: Path) -> None:
    _, digest, data = entry
    with ForwardingProxy(signing.url) as store, \
            _redirecting(signing.url, store.url) as proxy, \
            RemoteCache(ClientConfig(url=proxy.url, verify_key=keys[1],
                                     redirect_origins=f"{store.url}/")) as remote:
        assert remote.download_blob(digest, len(data), tmp_path / "got") == digest


def test_a_name_is_judged_by_the_address_it_resolves_to(
        signing: ServerProcess, entry: tuple[Any, str, bytes], tmp_path: Path) -> None:
    """Without a verify key an announcement counts for public addresses only, and a host
    name counts as what it resolves to: `localhost`, announced, is loopback and refused."""
    _, digest, data = entry
    with hostile("silent") as elsewhere:
        location = elsewhere.url.replace("127.0.0.1", "localhost")
        with _redirecting(signing.url, location, _announce(None, location)) as proxy, \
                RemoteCache(ClientConfig(url=proxy.url)) as remote, \
                pytest.raises(RedirectRefused, match="to localhost, a loopback address"):
            remote.download_blob(digest, len(data), tmp_path / "got")
        elsewhere.settle()
        assert elsewhere.requests == []


@pytest.mark.parametrize("store_answer", ["wrong bytes", "403"])
def test_what_the_trainer_sends_back_carries_nothing_of_a_foreign_answer(
        store_answer: str, signing: ServerProcess, keys: tuple[Signer, str, Path],
        entry: tuple[Any, str, bytes], tmp_path: Path) -> None:
    """The announced store answers 200 with other bytes (the run is `invalid`, the blob is
    reported) or 403 with a body (the run is `error`): the event's reason and the report's
    detail name the step, the status and the host, never the size, hash or body."""
    fp, digest, data = entry
    served = b"Q" * 7919
    secret = b"<Error><Code>AccessDenied</Code><Key>SECRET-CREDENTIALS</Key></Error>"
    wrong = store_answer == "wrong bytes"

    def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        return (200, {}, served) if wrong else (403, {"content-type": "text/xml"}, secret)

    with ForwardingProxy(signing.url, answer=answer) as store, \
            _redirecting(signing.url, store.url, _announce(keys[0], store.url)) as proxy:
        session = _load(proxy.url, keys[1], fp, tmp_path)
        result = session.load_result
        if session._reporter is not None:
            session._reporter.join(10)
        session.report()
        session.retire()
        sent = [(path, json.loads(body)) for method, path, body in proxy.seen
                if method == "POST" and body]
    assert result.outcome == ("invalid" if wrong else "error"), result.reason
    texts = [e["reason"] for p, e in sent if p == "/v1/events"]
    texts += [r["detail"] for p, r in sent if p.endswith("/report")]
    assert texts and (len(texts) == 2 if wrong else len(texts) == 1), sent
    foreign = [str(len(served)), hashlib.sha256(served).hexdigest()[:12], "SECRET",
               "AccessDenied", "Error>"]
    assert not [(t, f) for t in texts for f in foreign if f in t], texts
    if not wrong:
        assert "HTTP 403 from 127.0.0.1" in texts[0], texts


def test_address_classes() -> None:
    assert address_class("169.254.169.254") == "link-local"
    assert address_class("fe80::1") == "link-local"
    assert address_class("::ffff:169.254.169.254") == "link-local"
    assert address_class("127.0.0.2") == "loopback"
    assert {address_class(a) for a in ("10.1.2.3", "172.16.0.1", "192.168.1.1", "fd00::1",
                                       "100.100.100.200", "0.0.0.0")} == {"private"}
    assert address_class("8.8.8.8") == "public"
