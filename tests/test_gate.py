"""The gate (megacache_client/transport/trust.py) on its own: what it refuses of an answer,
and what it admits of a file, before anything reaches torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_fingerprint, make_manifest

from megacache_client.config import ClientConfig
from megacache_client.errors import UntrustedEntryError, UntrustedWriterError
from megacache_client.transport.nodecache import NodeCache
from megacache_client.transport.trust import Gate
from megacache_client.wire import headers


def _gate(tmp: Path, **config: object) -> Gate:
    return Gate(ClientConfig(url="http://127.0.0.1:1", node_cache_dir=tmp / "node",
                             **config).validated())  # type: ignore[arg-type]


def _answer(sequence: int | None, writer: str = "ci-main") -> tuple[bytes, dict[str, str]]:
    manifest = make_manifest({"megacache": b"bundle"}, make_fingerprint(model="gate"))
    record: dict[str, object] = {"writer": writer, "writer_scopes": ["read", "write"]}
    if sequence is not None:
        record["sequence"] = sequence
    return manifest.to_json(), {"etag": '"e"', headers.PROVENANCE: json.dumps(record)}


def test_an_older_version_than_the_node_has_seen_is_refused(tmp_path: Path) -> None:
    body, newer = _answer(7)
    key = json.loads(body)["key"]
    assert _gate(tmp_path).entry(key, body, newer).key == key
    # another process of the node (a new gate on the same node cache) sees the replay
    _, older = _answer(5)
    with pytest.raises(UntrustedEntryError, match="older than version 7"):
        _gate(tmp_path).entry(key, body, older)
    _, same = _answer(7)
    assert _gate(tmp_path).entry(key, body, same).key == key  # the same version again
    _, unsaid = _answer(None)
    assert _gate(tmp_path).entry(key, body, unsaid).key == key  # an older server says none
    # another node has seen nothing yet
    assert _gate(tmp_path / "other").entry(key, body, older).key == key


def test_a_version_pinned_for_this_job_attempt_may_be_older_than_one_seen(
        tmp_path: Path) -> None:
    """Ranks of one attempt load the version it resolved to even after a newer one was
    published (and seen by this node); only an answer pinned for this attempt may be
    older: the same manifest as a plain lookup, or pinned for another attempt, is refused."""
    body, newer = _answer(7)
    key = json.loads(body)["key"]
    assert _gate(tmp_path).entry(key, body, newer).key == key
    _, pinned = _answer(5)
    record = json.loads(pinned[headers.PROVENANCE])
    pinned[headers.PROVENANCE] = json.dumps(record | {"resolved_for": {"job": "j", "attempt": 0}})
    assert _gate(tmp_path).entry(key, body, pinned, job=("j", 0)).key == key
    for job in (None, ("j", 1), ("k", 0)):
        with pytest.raises(UntrustedEntryError, match="older than version 7"):
            _gate(tmp_path).entry(key, body, pinned, job=job)
    # an answer pinned for the attempt does not lower what the node has seen
    with pytest.raises(UntrustedEntryError, match="older than version 7"):
        _gate(tmp_path).entry(key, body, _answer(6)[1])


def test_the_writer_policy_and_the_key_are_checked(tmp_path: Path) -> None:
    body, answer = _answer(1, writer="trainer-x")
    key = json.loads(body)["key"]
    with pytest.raises(UntrustedWriterError, match="trainer-x"):
        _gate(tmp_path, trusted_writers="ci-*").entry(key, body, answer)
    with pytest.raises(UntrustedEntryError, match="answered with the manifest of"):
        _gate(tmp_path).entry("0" * 64, body, answer)
    assert _gate(tmp_path).entry("0" * 64, body, answer, fallback=True).key == key


def test_with_a_verify_key_an_answer_without_its_signed_provenance_is_refused(
        tmp_path: Path) -> None:
    body, answer = _answer(1)
    del answer[headers.PROVENANCE]
    gate = _gate(tmp_path, verify_key="ed25519:" + "A" * 43 + "=")
    with pytest.raises(UntrustedEntryError, match="without its signed provenance"):
        gate.entry(json.loads(body)["key"], body, answer)


def test_only_a_file_the_node_cache_verified_and_left_unchanged_is_admitted(
        tmp_path: Path) -> None:
    gate = _gate(tmp_path)
    body, answer = _answer(1)
    entry = gate.entry(json.loads(body)["key"], body, answer)
    node = NodeCache(tmp_path / "node")
    path = node.path(entry.manifest.blobs[0].digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"bundle")
    with pytest.raises(UntrustedEntryError, match="not verified"):
        gate.admit(entry, "megacache", path)  # written, never hashed
    ref = entry.manifest.blobs[0]
    assert NodeCache.verified(path, ref.digest, ref.size)
    assert gate.admit(entry, "megacache", path).path == path
    path.write_bytes(b"BUNDLE")  # changed since it was hashed
    with pytest.raises(UntrustedEntryError, match="not verified"):
        gate.admit(entry, "megacache", path)
    with pytest.raises(UntrustedEntryError, match="names no kernels blob"):
        gate.admit(entry, "kernels", path)


def test_a_blob_that_would_expand_past_the_cap_is_not_admitted(tmp_path: Path) -> None:
    gate = _gate(tmp_path, max_raw_bytes=1000)
    manifest = make_manifest({"megacache": b"bundle"}, make_fingerprint(model="gate"))
    big = manifest.replace(blobs=[manifest.blobs[0].__class__(
        **{**manifest.blobs[0].to_dict(), "raw_size": 10**6, "compression": "zstd"})])
    entry = gate.entry(big.key, big.to_json(), {"etag": '"e"'})
    with pytest.raises(UntrustedEntryError, match="over the cap of 1000"):
        gate.admit(entry, "megacache", tmp_path / "x")
