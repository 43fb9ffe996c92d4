"""The manifest: the small JSON document an index entry maps a fingerprint key to.

It lives in the client package (base install, pydantic only) so the server and the
trainer-side client validate exactly the same schema without the client importing FastAPI.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

MANIFEST_FORMAT: Literal[1] = 1
"""Bump when the manifest or the fingerprint recipe changes incompatibly; it is hashed into keys."""

HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_BLOBS_PER_ENTRY = 16


def is_hex64(value: str) -> bool:
    """True for a lowercase 64-hex string: the only shape a digest or key may take."""
    return bool(HEX64.fullmatch(value))


HEX64_PATTERN = r"^[0-9a-f]{64}$"
Hex64 = Annotated[str, StringConstraints(pattern=HEX64_PATTERN)]
"""A sha256 as 64 lowercase hex characters; the pattern shows in the OpenAPI schema too."""
NAMESPACE_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
"""A namespace: what fingerprints, tokens and listings are scoped by."""
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Scalar = str | int | FiniteFloat | bool | None
"""A fingerprint value. NaN and infinities are refused: JSON cannot carry them, so a server
that accepted one would store a `null` that fails validation on every later read."""
ShortText = Annotated[str, Field(min_length=1, max_length=256)]


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


class _Strict(BaseModel):
    """Unknown fields refused, no type coercion: what the JSON schema says is what passes."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class BlobRef(_Strict):
    """One content-addressed blob an entry needs (bundle, kernel pack, toolchain artifacts)."""

    digest: Hex64 = Field(description="sha256 of the bytes as stored (the CAS address)")
    size: int = Field(ge=0, le=2**53, description="stored size in bytes")
    role: str = Field(
        pattern=r"^[a-z][a-z0-9_-]{0,31}$",
        description="what the blob is: megacache, kernels, toolchain, ...",
    )
    compression: Literal["zstd", "none"] = "zstd"
    raw_size: int | None = Field(default=None, ge=0, le=2**53,
                                 description="size after decompression")
    raw_sha256: Hex64 | None = Field(default=None, description="sha256 after decompression")
    meta: dict[ShortText, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict,
        description="role-specific facts the consumer checks before using the blob",
    )


class Fingerprint(_Strict):
    """The components the key is derived from. Never a hostname, path, PID, rank or time."""

    namespace: str = Field(default="default", pattern=NAMESPACE_PATTERN)
    model: ShortText
    code: ShortText
    env: dict[ShortText, Scalar] = Field(default_factory=dict)
    hw: dict[ShortText, Scalar] = Field(default_factory=dict)
    config: dict[ShortText, Scalar] = Field(default_factory=dict)

    def key(self) -> str:
        """The fingerprint key: sha256 of the canonical JSON of format + components."""
        return sha256_hex(canonical_json({"format": MANIFEST_FORMAT, **self.model_dump()}))


def component_digest(component: dict[str, Scalar]) -> str:
    """Digest of one component (env, hw, ...), used to filter listings by equality."""
    return sha256_hex(canonical_json(component))


class Manifest(_Strict):
    """An index entry's value. Small, validated strictly, unknown fields refused."""

    format: Literal[1] = MANIFEST_FORMAT
    key: Hex64
    blobs: list[BlobRef] = Field(min_length=1, max_length=MAX_BLOBS_PER_ENTRY)
    fingerprint: Fingerprint
    torch_version: ShortText
    triton_version: str | None = Field(default=None, max_length=256)
    artifact_counts: dict[ShortText, Annotated[int, Field(ge=0, le=2**53)]] = Field(
        default_factory=dict)
    cold_compile_s: float = Field(ge=0, le=7 * 24 * 3600, allow_inf_nan=False)
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    producer: dict[ShortText, Annotated[str, Field(max_length=256)]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _key_matches_fingerprint(self) -> Manifest:
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
        return self

    def blob(self, role: str) -> BlobRef | None:
        return next((b for b in self.blobs if b.role == role), None)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()
