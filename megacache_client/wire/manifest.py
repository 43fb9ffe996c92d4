"""The manifest: the small JSON document an index entry maps a fingerprint key to.

It lives in the wire contract (base install, standard library only: see `schema.py`) so
the server and the trainer-side client validate exactly the same schema without the
client importing FastAPI or pydantic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from megacache_client.wire.schema import Doc, Finite, Match, Range, Schema, Size, Text, parse_json

MANIFEST_FORMAT: Literal[1] = 1
"""Bump when the manifest or the fingerprint recipe changes incompatibly; it is hashed into keys."""

HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_BLOBS_PER_ENTRY = 16


def is_hex64(value: str) -> bool:
    """True for a lowercase 64-hex string: the only shape a digest or key may take."""
    return bool(HEX64.fullmatch(value))


HEX64_PATTERN = r"^[0-9a-f]{64}$"
Hex64 = Annotated[str, Match(HEX64_PATTERN)]
"""A sha256 as 64 lowercase hex characters; the pattern shows in the OpenAPI schema too."""
NAMESPACE_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
"""A namespace: what fingerprints, tokens and listings are scoped by."""
FiniteFloat = Annotated[float, Finite()]
VALUE_CAP = 256
"""The longest string a fingerprint component or the producer holds, in characters. The
largest the client sends is 37 (`hw.cxx`, the compiler's version line; torch.compile's
options enter `config` as a digest): a 63 KB string in `config` made each listing of a
thousand entries 60 MiB (#58)."""
COMPONENT_ENTRIES = 64
"""Entries of one fingerprint component (env, hw, config): the client sends 5, 5 and 9."""
SMALL_DICT_ENTRIES = 32
"""Entries of a blob's meta, the artifact counts and the producer: the client sends at most
~16 meta entries (build facts and precompile's), ~10 counts and 2 producer entries."""
Scalar = Annotated[str, Size(0, VALUE_CAP), Text()] | int | FiniteFloat | bool | None
"""A fingerprint value: a string is text by the one rule (wire/text.py) of at most
VALUE_CAP characters. NaN and infinities are refused: JSON cannot carry them, so a server
that accepted one would store a `null` that fails validation on every later read."""
ShortText = Annotated[str, Size(1, 256), Text()]
"""A name (model, code, torch version, a component's or meta key): text by the one rule
(wire/text.py)."""
Component = Annotated[dict[ShortText, Scalar], Size(0, COMPONENT_ENTRIES)]
Size53 = Annotated[int, Range(0, 2**53)]
"""A byte size or count: JSON numbers are exact to 2**53."""


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace, so equal values hash equally everywhere."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1024 * 1024) -> str:
    """sha256 of a file, read in large chunks (blobs can be gigabytes)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            sha.update(data)
    return sha.hexdigest()


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlobRef(Schema):
    """One content-addressed blob an entry needs (bundle, kernel pack, toolchain artifacts)."""

    digest: Annotated[Hex64, Doc("sha256 of the bytes as stored (the CAS address)")]
    size: Annotated[Size53, Doc("stored size in bytes")]
    role: Annotated[str, Match(r"^[a-z][a-z0-9_-]{0,31}$"),
                    Doc("what the blob is: megacache, kernels, toolchain, ...")]
    compression: Literal["zstd", "none"] = "zstd"
    raw_size: Annotated[Size53 | None, Doc("size after decompression")] = None
    raw_sha256: Annotated[Hex64 | None, Doc("sha256 after decompression")] = None
    meta: Annotated[dict[ShortText, Annotated[str, Size(0, 4096), Text()]],
                    Size(0, SMALL_DICT_ENTRIES),
                    Doc("role-specific facts the consumer checks before using the blob")] = \
        dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fingerprint(Schema):
    """The components the key is derived from. Never a hostname, path, PID, rank or time."""

    namespace: Annotated[str, Match(NAMESPACE_PATTERN)] = "default"
    model: ShortText
    code: ShortText
    env: Component = dataclasses.field(default_factory=dict)
    hw: Component = dataclasses.field(default_factory=dict)
    config: Component = dataclasses.field(default_factory=dict)

    def key(self) -> str:
        """The fingerprint key: sha256 of the canonical JSON of format + components."""
        return sha256_hex(canonical_json({"format": MANIFEST_FORMAT, **self.to_dict()}))


def component_digest(component: dict[str, Scalar]) -> str:
    """Digest of one component (env, hw, ...), used to filter listings by equality."""
    return sha256_hex(canonical_json(component))


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest(Schema):
    """An index entry's value. Small, validated strictly, unknown fields refused."""

    format: Literal[1] = MANIFEST_FORMAT
    key: Hex64
    blobs: Annotated[list[BlobRef], Size(1, MAX_BLOBS_PER_ENTRY)]
    fingerprint: Fingerprint
    torch_version: ShortText
    triton_version: Annotated[str, Size(0, 256), Text()] | None = None
    artifact_counts: Annotated[dict[ShortText, Size53], Size(0, SMALL_DICT_ENTRIES)] = \
        dataclasses.field(default_factory=dict)
    cold_compile_s: Annotated[float, Range(0, 7 * 24 * 3600)]
    created_at: datetime = dataclasses.field(default_factory=_now)
    producer: Annotated[dict[ShortText, Annotated[str, Size(0, VALUE_CAP), Text()]],
                        Size(0, SMALL_DICT_ENTRIES)] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        expected = self.fingerprint.key()
        if self.key != expected:
            raise ValueError(
                f"key {self.key} does not match its fingerprint components (expected {expected})"
            )
        digests = [b.digest for b in self.blobs]
        if len(set(digests)) != len(digests):
            raise ValueError("a blob is listed twice")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must carry a timezone")

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """A manifest from untrusted JSON (a server's answer), strictly validated."""
        return parse_json(cls, data)

    def blob(self, role: str) -> BlobRef | None:
        return next((b for b in self.blobs if b.role == role), None)

    def replace(self, **changes: Any) -> Manifest:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)
