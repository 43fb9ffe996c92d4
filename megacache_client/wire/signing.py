"""Ed25519 manifest signatures: the server signs with a private key, clients hold the public key.

An HMAC key would let every verifier sign too; with Ed25519 a trainer that can check a
manifest cannot forge one. What is signed is not the manifest bytes alone but the bytes
bound to the fingerprint key and namespace they are served for, so a validly signed
manifest of another key (or another namespace) replayed in answer to a lookup fails the
check. The signature is made when the entry is served: it protects the way from the server
to the trainer (proxies, caches, a man in the middle), not against a compromised server.

`cryptography` is imported only when a signature is made or checked: the base client install
does not need it unless `MEGACACHE_VERIFY_KEY` is set (`pip install 'megacache[verify]'`).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

SIGNATURE_PREFIX = "ed25519="
PUBLIC_KEY_PREFIX = "ed25519:"
_DOMAIN = b"megacache-manifest-v1"
_DOMAIN_V2 = b"megacache-manifest-v2"


class SigningError(ValueError):
    """A key that cannot be used, or signing support that is not installed."""


def signed_message(key: str, namespace: str, manifest_json: bytes,
                   provenance: str | None = None) -> bytes:
    """What the signature covers: a fixed domain tag, the key, the namespace, the bytes.

    Key and namespace are fixed-shape (hex, a restricted charset) and NUL-separated, so no
    two different triples make the same message. With `provenance` (who wrote the entry:
    `x-megacache-provenance`, ASCII JSON, never a NUL) the message has another domain tag
    and the provenance before the bytes: what `x-megacache-provenance-signature` covers, so
    neither the writer nor the bytes can be swapped. `x-megacache-signature` stays the
    signature without it, so every verifier of it works as before.
    """
    if provenance:
        return b"\0".join((_DOMAIN_V2, key.encode(), namespace.encode(),
                           provenance.encode("ascii", "replace"), manifest_json))
    return b"\0".join((_DOMAIN, key.encode(), namespace.encode(), manifest_json))


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise SigningError("manifest signatures need the `cryptography` package: "
                           "pip install 'megacache[verify]'") from exc
    return ed25519


def public_key_bytes(text: str) -> bytes:
    """The 32 raw bytes of an `ed25519:<base64>` public key (checked without cryptography)."""
    if not text.startswith(PUBLIC_KEY_PREFIX):
        raise SigningError(f"a verify key looks like {PUBLIC_KEY_PREFIX}<base64>, not {text!r}")
    try:
        raw = base64.b64decode(text[len(PUBLIC_KEY_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise SigningError("the verify key is not valid base64") from None
    if len(raw) != 32:
        raise SigningError(f"an Ed25519 public key has 32 bytes, this one {len(raw)}")
    return raw


def signature_valid(public_key: str, key: str, namespace: str, manifest_json: bytes,
                    signature: str | None, provenance: str | None = None) -> bool:
    """True if `signature` is the server's signature of this manifest for this key/namespace
    (and of `provenance`, the `x-megacache-provenance` it was served with, if any)."""
    if not signature or not signature.startswith(SIGNATURE_PREFIX):
        return False
    ed25519 = _ed25519()
    from cryptography.exceptions import InvalidSignature

    try:
        raw_sig = base64.b64decode(signature[len(SIGNATURE_PREFIX):], validate=True)
        ed25519.Ed25519PublicKey.from_public_bytes(public_key_bytes(public_key)).verify(
            raw_sig, signed_message(key, namespace, manifest_json, provenance))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


class Signer:
    """The server's private key, loaded once from a PEM file."""

    def __init__(self, private_key: Any) -> None:
        self._key = private_key

    @classmethod
    def from_file(cls, path: Path) -> Signer:
        from cryptography.hazmat.primitives import serialization

        ed25519 = _ed25519()
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise SigningError(f"cannot load the signing key {path}: {exc}") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise SigningError(f"{path} is not an Ed25519 private key")
        return cls(key)

    def sign(self, key: str, namespace: str, manifest_json: bytes,
             provenance: str | None = None) -> str:
        """The `x-megacache-signature` value for this manifest served under key/namespace
        (with its provenance, when it has one)."""
        sig = self._key.sign(signed_message(key, namespace, manifest_json, provenance))
        return SIGNATURE_PREFIX + base64.b64encode(sig).decode()

    @property
    def public_key(self) -> str:
        """`ed25519:<base64>`: what clients set as MEGACACHE_VERIFY_KEY."""
        from cryptography.hazmat.primitives import serialization

        raw = self._key.public_key().public_bytes(serialization.Encoding.Raw,
                                                  serialization.PublicFormat.Raw)
        return PUBLIC_KEY_PREFIX + base64.b64encode(raw).decode()


def generate_private_key_pem() -> bytes:
    """A new Ed25519 private key as unencrypted PKCS#8 PEM (keep it 0600, server side only)."""
    from cryptography.hazmat.primitives import serialization

    key = _ed25519().Ed25519PrivateKey.generate()
    return bytes(key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
