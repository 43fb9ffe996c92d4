"""Every `x-megacache-*` header of the HTTP API, named once for both sides.

Sent by the server with a manifest: `SIGNATURE`, `PROVENANCE`, `PROVENANCE_SIGNATURE`,
`WRITER`, `WRITER_SCOPES`; with a job resolution: `RESOLUTION`, `RESOLVED_AT`,
`EXPIRES_AT`; with a blob redirect: `BLOB_ORIGIN`, `BLOB_ORIGIN_SIGNATURE`. Sent by the
client with every request, and recorded by the server in an entry's provenance when it
writes one: `CLIENT_VERSION`, `JOB`, `ATTEMPT`. A test checks that every header the server
reads is one the client sends.
"""

from __future__ import annotations

SIGNATURE = "x-megacache-signature"
"""`ed25519=<base64>`: the server's signature of the manifest for this key and namespace."""
PROVENANCE = "x-megacache-provenance"
"""Who wrote the entry: canonical ASCII JSON (writer, scopes, namespace, job, time)."""
PROVENANCE_SIGNATURE = "x-megacache-provenance-signature"
"""The signature of the manifest bound to its provenance."""
WRITER = "x-megacache-writer"
WRITER_SCOPES = "x-megacache-writer-scopes"
RESOLUTION = "x-megacache-resolution"
"""`hit`, `fallback` or `miss`: what a job attempt resolved a key to."""
RESOLVED_AT = "x-megacache-resolved-at"
EXPIRES_AT = "x-megacache-expires-at"
BLOB_ORIGIN = "x-megacache-blob-origin"
"""The origin a blob redirect goes to (the presigned store), as the server announces it."""
BLOB_ORIGIN_SIGNATURE = "x-megacache-blob-origin-signature"
"""The server's signature of `BLOB_ORIGIN` (`signing.origin_message`), when it signs."""
CLIENT_VERSION = "x-megacache-client-version"
JOB = "x-megacache-job"
ATTEMPT = "x-megacache-attempt"

SENT_BY_CLIENT = (CLIENT_VERSION, JOB, ATTEMPT)
