"""The server side of manifest signatures: load the Ed25519 private key once, sign on serve.

The scheme (what is signed, the header format) lives in megacache_client.wire.signing so both
ends share one definition.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from megacache_client.wire import headers as wire_headers
from megacache_client.wire.signing import (
    Signer,
    SigningError,
    blob_origin,
    generate_private_key_pem,
    origin_message,
)
from megacache_server.settings import Settings


@functools.lru_cache(maxsize=4)
def signer_for(path: Path) -> Signer:
    """The signer of a key file, loaded once per process (raises SigningError if unusable)."""
    return Signer.from_file(path)


def signature_headers(settings: Settings, key: str, namespace: str,
                      manifest_json: bytes, provenance: str = "") -> dict[str, str]:
    """`x-megacache-signature` for a manifest served under key/namespace, and with the
    provenance it is served with (if any) `x-megacache-provenance-signature`, covering the
    manifest bytes and the provenance together, when we sign."""
    if settings.signing_key_file is None:
        return {}
    signer = signer_for(settings.signing_key_file)
    found = {wire_headers.SIGNATURE: signer.sign(key, namespace, manifest_json)}
    if provenance:  # a second signature, so verifiers of the first work as before
        found[wire_headers.PROVENANCE_SIGNATURE] = signer.sign(key, namespace, manifest_json,
                                                         provenance)
    return found


def redirect_headers(settings: Settings, url: str) -> dict[str, str]:
    """The announcement a blob redirect carries: the origin it sends the client to (the
    presigned store) and, when we sign, our signature of that origin. A client follows a
    redirect only to our own origin or one we vouch for (`transport/redirects.py`): a proxy
    that answers blob reads with a redirect to an internal address cannot sign one."""
    origin = blob_origin(url)
    if not origin:
        return {}
    found = {wire_headers.BLOB_ORIGIN: origin}
    if settings.signing_key_file is not None:
        found[wire_headers.BLOB_ORIGIN_SIGNATURE] = signer_for(
            settings.signing_key_file).sign_message(origin_message(origin))
    return found


def check_signing_key(settings: Settings) -> None:
    """Fail at start-up, not on the first lookup, when the configured key cannot be used."""
    if settings.signing_key_file is not None:
        try:
            signer_for(settings.signing_key_file)
        except SigningError as exc:
            raise RuntimeError(str(exc)) from None
    if os.environ.get("MEGACACHE_SIGNING_KEY"):
        raise RuntimeError("MEGACACHE_SIGNING_KEY (an HMAC secret) is no longer used: "
                           "manifests are signed with Ed25519; run `megacache-server "
                           "signing-key generate --out FILE` and set MEGACACHE_SIGNING_KEY_FILE")


def write_new_key(path: Path) -> str:
    """Create a private key file (mode 0600, never overwritten); returns the public key."""
    pem = generate_private_key_pem()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return signer_for(path).public_key
