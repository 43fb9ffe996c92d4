"""The verify step: the one gate every artifact passes before torch or a compiler reads it.

A bundle is code the trainer runs (pickles, shared libraries, precompiled headers), so the
client places nothing it has not admitted here:

- `Gate.entry` turns what the server answered for a key into a `ServedEntry`, or refuses
  it: the manifest must be signed by the server for this key and namespace (with
  `MEGACACHE_VERIFY_KEY`), written by a trusted writer (`MEGACACHE_TRUSTED_WRITERS`), be
  the manifest of the key asked (or the fallback the server chose for it), and be no older
  than the newest version of that key this node has seen (a proxy replaying a superseded,
  validly signed manifest is a rollback). The transport hands out entries only through it.
- `Gate.admit` binds one blob of a `ServedEntry` to the file the node cache downloaded and
  verified (sha256 and size), within the size caps, built for this machine (packs), and
  returns an `Admitted`: the only thing the placing functions (`steps.load`) accept. A
  manifest from a listing is only a nomination: it is never a `ServedEntry`.

Whose bundles a consumer runs: token names (`ci-main`), name prefixes (`ci-*`), or a scope
only those writers' tokens hold (`scope:admin`): `wire.writers.WriterPolicy`, which the
server applies too when it chooses a fallback for the consumer. The server says who wrote each entry
(`x-megacache-provenance`); with `MEGACACHE_VERIFY_KEY` set that statement is covered by
the server's signature, without it it is only as good as the connection to the server.
An entry from anyone else is a miss ("untrusted writer"); the consumer does not publish
over it unless it is itself a trusted writer (`GET /v1/whoami`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from megacache_client.errors import UntrustedEntryError, UntrustedWriterError
from megacache_client.results import Admitted, ServedEntry
from megacache_client.torch import relocate
from megacache_client.torch.packs import pack_kind
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire import headers as wire_headers
from megacache_client.wire.manifest import Manifest
from megacache_client.wire.signing import SigningError, signature_valid

if TYPE_CHECKING:
    from collections.abc import Mapping

    from megacache_client.config import ClientConfig

class Gate:
    """The client's checks on everything it would hand to torch, in one place."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.policy = config.writer_policy
        self.seen = SeenVersions(config.node_cache_dir)

    # -- entries ------------------------------------------------------------------------
    def entry(self, asked: str, body: bytes, headers: Mapping[str, str], *,
              fallback: bool = False, job: tuple[str, int] | None = None) -> ServedEntry:
        """What the server answered for `asked`, refused (UntrustedEntryError,
        UntrustedWriterError) unless every check passes. `fallback`: the server may answer
        with another key's manifest, chosen for this one (the signature covers the key
        asked). `job`: the (job, attempt) whose resolution this answers: a version pinned
        for it (its provenance says so) may be older than one this node has seen."""
        etag = headers.get("etag", "")
        provenance = headers.get(wire_headers.PROVENANCE)
        self._check_signature(asked, body, headers, provenance)
        if self.policy is not None:
            why = self.policy.refusal(provenance)
            if why:
                raise UntrustedWriterError(f"entry {asked[:12]}… {why}", asked, etag)
        manifest = Manifest.from_json(body)
        if manifest.key != asked and not fallback:
            raise UntrustedEntryError(f"asked for entry {asked[:12]}…, the server answered "
                                      f"with the manifest of {manifest.key[:12]}…: refusing it")
        if job is None or resolved_for(provenance) != job:
            self.seen.check(manifest.key, sequence_of(provenance))
        return ServedEntry(manifest, etag, provenance, asked)

    def _check_signature(self, asked: str, body: bytes, headers: Mapping[str, str],
                         provenance: str | None) -> None:
        """With a verify key, the manifest must be signed by the server for this key and the
        client's namespace (a signature of another entry, replayed here, does not verify),
        and so must its provenance: who wrote it and which version it is (a proxy that
        strips the provenance to replay an older version is refused here)."""
        public_key = self.config.verify_key
        if not public_key:
            return
        namespace = self.config.namespace
        if not provenance:  # who wrote it and which version: signed, or a replay could hide
            raise UntrustedEntryError(f"entry {asked[:12]}… came without its signed "
                                      "provenance: refusing a manifest whose writer and "
                                      "version cannot be checked")
        try:
            ok = signature_valid(public_key, asked, namespace, body,
                                 headers.get(wire_headers.SIGNATURE)) \
                and signature_valid(public_key, asked, namespace, body,
                                    headers.get(wire_headers.PROVENANCE_SIGNATURE), provenance)
        except SigningError as exc:
            raise UntrustedEntryError(f"cannot verify entry {asked[:12]}…: {exc}") from None
        if not ok:
            raise UntrustedEntryError(f"entry {asked[:12]}… has no valid signature for "
                                      f"this key and namespace {namespace!r}: "
                                      "refusing to load a manifest the server did not sign")

    # -- blobs --------------------------------------------------------------------------
    def admit(self, entry: ServedEntry, role: str, path: Path) -> Admitted:
        """The `role` blob of `entry` at `path`, fit to place: named by the admitted
        manifest, verified on disk by the node cache (sha256 and size, unchanged since),
        within the size caps, and (for packs) built for this machine."""
        ref = entry.manifest.blob(role)
        if ref is None:
            raise UntrustedEntryError(f"entry {entry.key[:12]}… names no {role} blob")
        cap = self.config.max_raw_bytes
        if ref.raw_size is not None and ref.raw_size > cap:
            raise UntrustedEntryError(f"the {role} blob of entry {entry.key[:12]}… would "
                                      f"expand to {ref.raw_size} bytes, over the cap of {cap}")
        if not NodeCache.was_verified(path, ref.digest, ref.size):
            raise UntrustedEntryError(f"the {role} blob {ref.digest[:12]}… at {path} was not "
                                      "verified against its digest by the node cache")
        if pack_kind(role) is not None:
            refused = relocate.refusal(ref.meta)
            if refused:
                raise UntrustedEntryError(f"the {role} pack of entry {entry.key[:12]}… "
                                          f"{refused}")
        return Admitted(entry, ref, path)


def sequence_of(provenance: str | None) -> int | None:
    """The server's version number of an entry, from its provenance (None: not said)."""
    if not provenance:
        return None
    try:
        value = json.loads(provenance).get("sequence")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def resolved_for(provenance: str | None) -> tuple[str, int] | None:
    """The job attempt a resolution's answer was pinned for (None: a plain lookup's)."""
    try:
        pinned = json.loads(provenance or "{}").get("resolved_for") or {}
        return str(pinned["job"]), int(pinned["attempt"])
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


class SeenVersions:
    """The newest version of each key this node has admitted, so a replayed older version
    (a proxy serving a superseded, validly signed manifest) is refused. One small file per
    key under the node cache, updated under a lock: every rank of the node shares it."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "seen"

    def check(self, key: str, sequence: int | None) -> None:
        if sequence is None or not re.fullmatch(r"[0-9a-f]{64}", key):
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / key
            with FileLock(str(path) + ".lock", timeout=10):
                newest = _read_int(path)
                if newest is not None and sequence < newest:
                    raise UntrustedEntryError(
                        f"entry {key[:12]}… is version {sequence}, older than version "
                        f"{newest} this node has seen: refusing a rolled-back manifest")
                if newest is None or sequence > newest:
                    tmp = path.with_name(f".{key}.{os.getpid()}.tmp")
                    tmp.write_text(str(sequence))
                    os.replace(tmp, path)
        except OSError:  # an unwritable node cache: the check degrades to this process
            return


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None

