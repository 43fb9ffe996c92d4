"""Who wrote an entry: recorded by the server when the entry is written, served with it.

A bundle is code every reader runs, so a consumer may want to accept only some writers
(`MEGACACHE_TRUSTED_WRITERS` on the client: token names, or a scope only CI tokens hold).
The server attests what it knows itself (the writing token's id, name, scopes and
namespace, when, whether the write replaced an earlier version, and the version's
`sequence`: above every earlier version of the key, across deletes and replicas, set by the
index as it writes, `EntryStore.put`) and records what the producer says of itself (client
version, job id and attempt; strictly validated, 422 otherwise). It is kept as one
canonical JSON string (sorted keys, no spaces, ASCII), served as `x-megacache-provenance`
with the manifest and, when the server signs, covered by the signature
(`megacache_client.wire.signing.signed_message`). A client remembers the highest
`sequence` it has seen per key and refuses an older version: a proxy cannot roll an entry
back to a superseded manifest the server once signed.

An entry written before provenance existed is served with `UNKNOWN`'s (no writer, sequence
0), signed like any other: a client with a verify key can then always require a signed
provenance, and no writers policy trusts it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from megacache_client.wire import headers as wire_headers
from megacache_server.errors import Unprocessable
from megacache_server.service.security.auth import Principal
from megacache_server.store.index.base import canonical

VERSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}")
JOB_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # jobs.ID_PATTERN's rule
ATTEMPT_PATTERN = re.compile(r"0|[1-9][0-9]{0,6}")
MAX_ATTEMPT = 1_000_000


@dataclass(frozen=True)
class ProducerClaims:
    """What the producer says of itself, from request headers (None: not said)."""

    client_version: str | None = None
    job: str | None = None
    attempt: int | None = None

    @classmethod
    def from_headers(cls, client_version: str | None, job: str | None,
                     attempt: str | None) -> ProducerClaims:
        """Strictly validated: a value of another shape is refused (422) naming the rule,
        never echoed back whole nor stored."""
        if client_version is not None and not VERSION_PATTERN.fullmatch(client_version):
            raise Unprocessable(f"{wire_headers.CLIENT_VERSION} must be 1-64 of A-Z a-z 0-9 "
                                ". + _ -", code="invalid_client_version")
        if job is not None and not JOB_PATTERN.fullmatch(job):
            raise Unprocessable(f"{wire_headers.JOB} must be 1-128 of A-Z a-z 0-9 . _ -, starting "
                                "with a letter or digit", code="invalid_job")
        number = None
        if attempt is not None:
            if not ATTEMPT_PATTERN.fullmatch(attempt) or int(attempt) > MAX_ATTEMPT:
                raise Unprocessable(f"{wire_headers.ATTEMPT} must be an integer from 0 to "
                                    f"{MAX_ATTEMPT}", code="invalid_attempt")
            number = int(attempt)
        return cls(client_version, job, number)


def record(principal: Principal, namespace: str, claims: ProducerClaims, *,
           replaced: bool, written_at: float) -> str:
    """The canonical provenance string of an entry version."""
    return canonical({
        "v": 1,
        "writer": principal.name,
        "writer_id": principal.token_id,
        "writer_scopes": sorted(principal.scopes),
        "namespace": namespace,
        "client_version": claims.client_version,
        "job": claims.job,
        "attempt": claims.attempt,
        "replaced": replaced,
        "written_at": round(written_at, 3),
    })


def served(provenance: str, namespace: str) -> str:
    """What an entry version of `namespace` is served (and signed) with: its provenance, or
    for one stored without any, a record that names no writer, with sequence 0."""
    if provenance:
        return provenance
    return canonical(UNKNOWN | {"namespace": namespace})


def resolved_for(provenance: str, job: str, attempt: int) -> str:
    """A job resolution's answer: the pinned version's provenance, naming the job attempt it
    was pinned for. The version may be older than the key's newest (replaced after the
    attempt resolved it); signed with this, a client accepts it for that attempt only, and
    its rollback check still refuses the same manifest replayed as a plain lookup."""
    return canonical(json.loads(provenance) | {"resolved_for": {"job": job, "attempt": attempt}})


UNKNOWN = {"v": 1, "writer": "", "writer_id": "", "writer_scopes": [], "namespace": "",
           "client_version": None, "job": None, "attempt": None, "replaced": None,
           "written_at": None, "sequence": 0}
"""The provenance of an entry stored without one: nobody a writers policy names."""


def headers(provenance: str) -> dict[str, str]:
    """The provenance as response headers (served: never empty)."""
    if not provenance:
        return {}
    data = json.loads(provenance)
    found = {wire_headers.PROVENANCE: provenance,
             wire_headers.WRITER_SCOPES: ",".join(data["writer_scopes"])}
    if SAFE_NAME.fullmatch(data["writer"]):  # else only inside the (escaped) JSON
        found[wire_headers.WRITER] = data["writer"]
    return found


SAFE_NAME = re.compile(r"[A-Za-z0-9._@:+-]{1,128}")
