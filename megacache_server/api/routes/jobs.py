"""`/v1/ac/{key}/resolve` and `/v1/ac/{key}/claim`: what a fleet agrees on.

- resolve: every rank of one job attempt gets the answer its first rank got (the entry as it
  was then, or a miss), whatever is published meanwhile: no rank starts warm while another
  compiles.
- claim: one publisher per key across the fleet; the others skip the upload.

Bodies are small JSON objects read with a hard size limit; their values are checked by the
cache service (`service.caching.resolutions`), which owns the rules.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from megacache_client.wire import headers as wire_headers
from megacache_client.wire.manifest import HEX64_PATTERN, NAMESPACE_PATTERN
from megacache_client.wire.writers import MAX_POLICY_CHARS
from megacache_server.api.deps import Reader, Writer
from megacache_server.api.validation import small_json_body
from megacache_server.errors import NotFound, error_responses
from megacache_server.service.caching.resolutions import (
    DEFAULT_CLAIM_LEASE_S,
    DEFAULT_RESOLUTION_TTL_S,
    FallbackRule,
)
from megacache_server.service.security import provenance
from megacache_server.service.security.signing import signature_headers

router = APIRouter(prefix="/v1/ac", tags=["jobs"],
                   responses=error_responses(400, 401, 403, 413, 422, 431, 503))
Key = Annotated[str, Path(pattern=HEX64_PATTERN, description="fingerprint key")]
MAX_BODY = 4096
"""A resolve or claim body is a few dozen bytes; nothing larger is read."""


class FallbackRequest(BaseModel):
    """The client's fallback rule, applied once for the whole job attempt (see
    `Resolutions.resolve`): the newest entry of this model with these component digests, by a
    writer the consumer's trusted-writers policy (`writers`) trusts, when it sends one."""

    model_config = ConfigDict(extra="forbid", strict=True)
    namespace: Annotated[str, Field(pattern=NAMESPACE_PATTERN)]
    model: Annotated[str, Field(min_length=1, max_length=256)]
    env: Annotated[str, Field(pattern=HEX64_PATTERN)]
    hw: Annotated[str, Field(pattern=HEX64_PATTERN)]
    writers: Annotated[str | None, Field(max_length=MAX_POLICY_CHARS)] = None


class ResolveRequest(BaseModel):
    """Which job attempt asks, and how long its answer should outlive the last rank asking."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    job: str
    attempt: int = 0
    ttl_s: float = DEFAULT_RESOLUTION_TTL_S
    fallback: FallbackRequest | None = None


class ClaimRequest(BaseModel):
    """Who claims the publish (an opaque id the claimant makes up), and for how long."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    holder: str
    lease_s: float = DEFAULT_CLAIM_LEASE_S


def _body_of(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


@router.post(
    "/{key}/resolve",
    openapi_extra=_body_of(ResolveRequest),
    responses={200: {"description": "the job attempt's entry (a manifest)",
                     "content": {"application/json": {
                         "schema": {"$ref": "#/components/schemas/Manifest"}}}},
               404: {"description": "the job attempt resolved this key to a miss "
                                    "(`resolved_miss`)"}, **error_responses(429, 507)},
)
async def resolve(key: Key, request: Request, cache: Reader) -> Response:
    """The entry for `key` as this job attempt first saw it, or a miss, for every rank."""
    body = await small_json_body(request, ResolveRequest, MAX_BODY)
    rule = FallbackRule(**body.fallback.model_dump()) if body.fallback else None
    done = await cache.resolve(key, job=body.job, attempt=body.attempt, ttl_s=body.ttl_s,
                               fallback=rule)
    headers = {wire_headers.RESOLUTION: "hit" if done.hit else "miss",
               wire_headers.RESOLVED_AT: f"{done.resolved_at:.6f}",
               wire_headers.EXPIRES_AT: f"{done.expires_at:.6f}"}
    if not done.hit:
        raise NotFound(
            f"job {done.job!r} attempt {done.attempt} resolved key {key} to a miss: every "
            "rank of this attempt compiles it", code="resolved_miss", headers=headers,
            job=done.job, attempt=done.attempt, resolved_at=done.resolved_at,
            expires_at=done.expires_at)
    written = provenance.resolved_for(provenance.served(
        await cache.resolution_provenance(done), done.entry_namespace), done.job, done.attempt)
    headers |= {"etag": done.etag, **provenance.headers(written), **signature_headers(
        cache.settings, key, done.entry_namespace, done.manifest_json, written)}
    return Response(done.manifest_json, headers=headers, media_type="application/json")


@router.post("/{key}/claim", openapi_extra=_body_of(ClaimRequest), responses={
    200: {"description": "granted (or renewed): this holder uploads"},
    **error_responses(409, 429, 507)})
async def claim(key: Key, request: Request, cache: Writer) -> Response:
    """Claim the publish of `key`: granted unless another holder's lease is live (409)."""
    body = await small_json_body(request, ClaimRequest, MAX_BODY)
    got = await cache.claim(key, holder=body.holder, lease_s=body.lease_s)
    return Response(json.dumps({"granted": True, "holder": got.holder,
                                "expires_at": got.expires_at, "lease_s": body.lease_s}),
                    media_type="application/json")


@router.delete("/{key}/claim", status_code=204, responses=error_responses(409))
async def release_claim(key: Key, cache: Writer,
                        holder: Annotated[str, Query(max_length=256)]) -> Response:
    """Give up a claim (204 also when it had lapsed); 409 if another holder's is live."""
    await cache.release_claim(key, holder=holder)
    return Response(status_code=204)

