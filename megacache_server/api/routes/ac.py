"""`/v1/ac`: the index from fingerprint key to manifest (the "action cache")."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from megacache_client.wire import headers as wire_headers
from megacache_client.wire.manifest import HEX64_PATTERN
from megacache_client.wire.writers import MAX_POLICY_CHARS
from megacache_server.api.budget import budgeted
from megacache_server.api.deps import Admin, Reader, Writer
from megacache_server.api.validation import request_body, require_content_length
from megacache_server.errors import PayloadTooLarge, error_responses
from megacache_server.service.caching.tenant import Precondition, StoredEntry, TenantCache
from megacache_server.service.limits.views import page
from megacache_server.service.security import provenance
from megacache_server.service.security.signing import signature_headers

router = APIRouter(prefix="/v1/ac", tags=["ac"],
                   responses=error_responses(400, 401, 403, 422, 431, 503))
Key = Annotated[str, Path(pattern=HEX64_PATTERN, description="fingerprint key")]

MANIFEST_REF = "#/components/schemas/Manifest"
MANIFEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": MANIFEST_REF}}},
    }
}


def _json(data: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(data, status_code=status, headers=headers, media_type="application/json")


@router.put(
    "/{key}",
    status_code=201,
    openapi_extra=MANIFEST_BODY,
    responses={200: {"description": "replaced"},
               **error_responses(408, 411, 412, 413, 424, 507)},
)
async def put_entry(key: Key, request: Request, cache: Writer) -> Response:
    """Write the manifest for `key`. Every blob it names must already be stored (424 if not).

    `If-None-Match: *` writes only if absent; `If-Match: <etag>` only over that version.
    The entry records who wrote it: the token, and `X-Megacache-Client-Version`,
    `X-Megacache-Job`, `X-Megacache-Attempt` when sent (422 if malformed).
    """
    limit = int(cache.settings.max_manifest_size)
    require_content_length(request.headers.get("content-length"), limit, "manifest")
    body = await _read_limited(request, limit)
    claims = provenance.ProducerClaims.from_headers(
        request.headers.get(wire_headers.CLIENT_VERSION),
        request.headers.get(wire_headers.JOB),
        request.headers.get(wire_headers.ATTEMPT))
    done = await cache.put_entry(key, body, Precondition(
        if_match=request.headers.get("if-match"),
        if_none_match=request.headers.get("if-none-match")), claims=claims)
    return _json(body, 201 if done.created else 200, _entry_headers(cache, done.entry))


@router.get("/{key}", responses={
    200: {"content": {"application/json": {"schema": {"$ref": MANIFEST_REF}}}},
    304: {"description": "unchanged"}, **error_responses(404)})
async def get_entry(key: Key, request: Request, cache: Reader) -> Response:
    """The manifest for `key`, with its ETag (and signature, when the server signs)."""
    entry = await cache.get_entry(key)
    if request.headers.get("if-none-match") == entry.etag:
        return Response(status_code=304, headers={"etag": entry.etag})
    return _json(entry.manifest_json, headers=_entry_headers(cache, entry))


@router.get("", responses={200: {"description": "entries, newest first", "content": {
    "application/json": {"schema": {"type": "object", "required": ["entries"], "properties": {
        "entries": {"type": "array", "items": {"$ref": MANIFEST_REF}},
        "next_offset": {"type": "integer", "description": "the answer was cut at its byte "
                        "bound: the `offset` of the next page"}}}}}}, **error_responses(429)})
@budgeted
async def list_entries(
    cache: Reader,
    namespace: Annotated[str | None, Query(max_length=64)] = None,
    model: Annotated[str | None, Query(max_length=256)] = None,
    env: Annotated[str | None, Query(pattern=HEX64_PATTERN,
                                     description="component_digest(env)")] = None,
    hw: Annotated[str | None, Query(pattern=HEX64_PATTERN,
                                    description="component_digest(hw)")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    offset: Annotated[int, Query(ge=0, le=999, description=(
        "entries to skip (a page's `next_offset`); offset + limit reads at most 1,000"))] = 0,
    writers: Annotated[str | None, Query(
        max_length=MAX_POLICY_CHARS,
        description="a trusted-writers policy (MEGACACHE_TRUSTED_WRITERS): only entries "
                    "whose provenance passes it")] = None,
) -> Response:
    """Entries newest first, filtered by model, by env / hw component digests and by who
    wrote them (`writers`); at most 4 MiB of them an answer (`next_offset`: where the next
    page starts)."""
    async def first(n: int) -> list[bytes]:
        return [e.manifest_json for e in await cache.list_entries(
            namespace=namespace, model=model, env=env, hw=hw, limit=n, writers=writers)]

    pieces, after = await page(first, offset, min(limit, 1000 - offset))
    more = b',"next_offset":%d' % after if after is not None else b""
    return _json(b'{"entries":[' + b",".join(pieces) + b"]" + more + b"}")


@router.delete("/{key}", status_code=204, responses=error_responses(404))
async def delete_entry(key: Key, cache: Admin) -> Response:
    """Remove an entry (its blobs stay until garbage collection)."""
    await cache.delete_entry(key)
    return Response(status_code=204)


@router.put("/{key}/pin", status_code=204, responses=error_responses(404))
async def pin_entry(key: Key, cache: Admin) -> Response:
    """Pin an entry: eviction never removes it (nor, so, its blobs)."""
    await cache.set_pinned(key, True)
    return Response(status_code=204)


@router.delete("/{key}/pin", status_code=204, responses=error_responses(404))
async def unpin_entry(key: Key, cache: Admin) -> Response:
    """Unpin an entry: it ages out by last access like any other."""
    await cache.set_pinned(key, False)
    return Response(status_code=204)


def _entry_headers(cache: TenantCache, entry: StoredEntry) -> dict[str, str]:
    """ETag, who wrote the entry, and the signature binding these bytes and that provenance
    to this key and namespace."""
    written = provenance.served(entry.provenance, entry.namespace)
    return {"etag": entry.etag, **provenance.headers(written),
            **signature_headers(cache.settings, entry.key, entry.namespace,
                                entry.manifest_json, written)}


async def _read_limited(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request_body(request):
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"manifest is over {limit} bytes", limit=limit)
    return bytes(body)
