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
_DOMAIN_ORIGIN = b"megacache-blob-origin-v1"


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


def blob_origin(url: str) -> str:
    """The origin of an absolute URL, as both ends compare it: `scheme://host:port`, the
    scheme and host lower-case, the port always written (80 and 443 when implied), an IPv6
    host in brackets. "" for a URL that is not http(s) or has no host."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return ""
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in ("http", "https") or not host:
        return ""
    port = port if port is not None else (443 if scheme == "https" else 80)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def parse_origins(text: str) -> frozenset[str]:
    """`MEGACACHE_REDIRECT_ORIGINS` (comma- or space-separated URLs) as origins; a ValueError
    names an entry that is not an http(s) URL with a host."""
    found = set()
    for part in text.replace(",", " ").split():
        origin = blob_origin(part)
        if not origin:
            raise ValueError(f"{part[:80]!r} is not an http(s) origin "
                             "(like https://s3.example.com)")
        found.add(origin)
    return frozenset(found)


def origin_message(origin: str) -> bytes:
    """What the server's announcement of a blob origin (`x-megacache-blob-origin-signature`)
    signs: a domain tag of its own (no manifest signature can pass for one) and the origin."""
    return b"\0".join((_DOMAIN_ORIGIN, origin.encode("ascii", "replace")))


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
    return message_signature_valid(public_key, signed_message(
        key, namespace, manifest_json, provenance), signature)


def message_signature_valid(public_key: str, message: bytes, signature: str | None) -> bool:
    """True if `signature` (`ed25519=<base64>`) is the server's signature of `message`."""
    if not signature or not signature.startswith(SIGNATURE_PREFIX):
        return False
    ed25519 = _ed25519()
    from cryptography.exceptions import InvalidSignature

    try:
        raw_sig = base64.b64decode(signature[len(SIGNATURE_PREFIX):], validate=True)
        ed25519.Ed25519PublicKey.from_public_bytes(public_key_bytes(public_key)).verify(
            raw_sig, message)
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
        return self.sign_message(signed_message(key, namespace, manifest_json, provenance))

    def sign_message(self, message: bytes) -> str:
        """`ed25519=<base64>` of `message` (one of this module's domain-tagged messages)."""
        return SIGNATURE_PREFIX + base64.b64encode(self._key.sign(message)).decode()

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
