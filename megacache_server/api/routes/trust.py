"""Reports of bad blobs and unloadable entries, and the quarantine they lead to.

- `POST /v1/cas/{digest}/report`: a client met a blob failing its sha256 or size, a bundle
  that did not decompress, a pack that did not unpack, or torch raising while loading it.
  The server re-verifies the blob from its own store and quarantines it only if it is bad.
- `POST /v1/ac/{key}/report`: torch could not load this entry's bundle; enough independent
  reports withdraw the entry.
- `GET /v1/quarantine`: what was taken out of service, why, when and who found it.
- `GET /v1/whoami`: the caller's token name, scopes and namespace: what a client with a
  trusted-writers policy checks before it publishes over an entry it refused.

Reading is enough to report (trainers are read-only); what a caller may report on is what it
may read (404 otherwise, as GET). Rules live in the cache service (`service.security.quarantine`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from megacache_client.wire.events import JOB_ID_PATTERN
from megacache_client.wire.manifest import HEX64_PATTERN
from megacache_client.wire.text import check_text
from megacache_server.api.budget import budgeted
from megacache_server.api.deps import Reader
from megacache_server.api.validation import small_json_body
from megacache_server.errors import error_responses

router = APIRouter(tags=["trust"],
                   responses=error_responses(400, 401, 403, 404, 413, 422, 429, 431, 503))
Digest = Annotated[str, Path(pattern=HEX64_PATTERN, description="sha256 of the blob")]
Key = Annotated[str, Path(pattern=HEX64_PATTERN, description="fingerprint key")]
MAX_BODY = 4096
"""A report is a few hundred bytes; nothing larger is read."""


Detail = Annotated[str, Field(max_length=500), AfterValidator(check_text)]
"""What a client says went wrong: text by the wire's rule (it is logged and shown)."""


class BlobReport(BaseModel):
    """What was wrong with the blob as the client met it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["digest", "size", "decompress", "unpack", "load"]
    entry_key: str | None = Field(None, pattern=HEX64_PATTERN)
    detail: Detail = ""


class EntryReport(BaseModel):
    """torch raised while loading this entry's bundle (in job `job`, when given)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["load", "decompress", "unpack"] = "load"
    detail: Detail = ""
    job: str | None = Field(None, pattern=JOB_ID_PATTERN)


def _body_of(model: type[BaseModel]) -> dict[str, object]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


VERDICT_SCHEMA = {"type": "object", "required": ["verdict"], "properties": {
    "verdict": {"enum": ["ok", "quarantined", "counted", "withdrawn"]}}}
VERDICT: dict[int | str, dict[str, Any]] = {200: {
    "description": "the server's verdict",
    "content": {"application/json": {"schema": VERDICT_SCHEMA}}}}


@router.post("/v1/cas/{digest}/report", openapi_extra=_body_of(BlobReport),
             responses=VERDICT)
async def report_blob(digest: Digest, request: Request, cache: Reader) -> Response:
    """Report a blob that failed: re-verified at once; quarantined only if really bad."""
    body = await small_json_body(request, BlobReport, MAX_BODY)
    verdict = await cache.report_blob(digest, kind=body.kind, entry_key=body.entry_key,
                                      detail=body.detail)
    return Response(json.dumps(verdict), media_type="application/json")


@router.post("/v1/ac/{key}/report", openapi_extra=_body_of(EntryReport), responses=VERDICT)
async def report_entry(key: Key, request: Request, cache: Reader) -> Response:
    """Report that torch could not load this entry's bundle (counted per token and job)."""
    body = await small_json_body(request, EntryReport, MAX_BODY)
    verdict = await cache.report_entry(key, kind=body.kind, detail=body.detail, job=body.job)
    return Response(json.dumps(verdict), media_type="application/json")


@router.get("/v1/quarantine", responses={200: {"description": "records, newest first"},
                                         **error_responses(429)})
@budgeted
async def quarantine(cache: Reader,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Response:
    """Blobs quarantined and entries withdrawn that touch the caller's namespace."""
    records = await cache.quarantines(limit=limit)
    return Response(json.dumps({"quarantined": records}), media_type="application/json")



WHOAMI_SCHEMA = {"type": "object", "required": ["name", "scopes", "namespace"], "properties": {
    "name": {"type": "string"}, "scopes": {"type": "array", "items": {"type": "string"}},
    "namespace": {"type": ["string", "null"]}}}


@router.get("/v1/whoami", responses={200: {"description": "the caller as the server knows it",
                                           "content": {"application/json": {
                                               "schema": WHOAMI_SCHEMA}}}})
async def whoami(cache: Reader) -> Response:
    """Who the caller is: what provenance would record if it wrote an entry now."""
    p = cache.principal
    return Response(json.dumps({"name": p.name, "scopes": sorted(p.scopes),
                                "namespace": p.namespace}), media_type="application/json")
