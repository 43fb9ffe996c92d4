"""`/v1/cas/{digest}`: immutable blobs addressed by their sha256."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse

from megacache_client.manifest import HEX64_PATTERN
from megacache_server import eviction
from megacache_server.auth import Principal, require
from megacache_server.errors import InsufficientStorage, NotFound, error_responses
from megacache_server.ranges import parse_range
from megacache_server.storage import Storage, get_storage
from megacache_server.validation import request_body, require_content_length, require_hex64

router = APIRouter(prefix="/v1/cas", tags=["cas"],
                   responses=error_responses(400, 401, 403, 431, 503))
Digest = Annotated[str, Path(pattern=HEX64_PATTERN, description="sha256 of the blob")]
StorageDep = Annotated[Storage, Depends(get_storage)]
Reader = Annotated[Principal, Depends(require("read"))]
Writer = Annotated[Principal, Depends(require("write"))]

IMMUTABLE = "public, max-age=31536000, immutable"


def _blob_headers(digest: str, size: int) -> dict[str, str]:
    return {
        "etag": f'"{digest}"',
        "cache-control": IMMUTABLE,
        "accept-ranges": "bytes",
        "content-length": str(size),
    }


@router.put(
    "/{digest}",
    status_code=201,
    responses={200: {"description": "already stored"},
               **error_responses(408, 411, 413, 507)},
)
async def put_blob(digest: Digest, request: Request, storage: StorageDep,
                   principal: Writer) -> JSONResponse:
    """Upload a blob; the body must hash to `digest`. Idempotent."""
    require_hex64(digest, "digest")
    size = require_content_length(
        request.headers.get("content-length"), int(storage.settings.max_blob_size), "blob"
    )
    budget = storage.settings.store_budget
    if budget is not None and await storage.blobs.stat(digest) is None:
        await _make_room(storage, size, int(budget))
    created = await storage.blobs.put(digest, size, request_body(request))
    await storage.index.record_blob(digest, size)
    if principal.namespace is not None:
        # created means "new to your namespace": whether another team stored these bytes
        # is not yours to learn (they were just verified, so the uploader holds them)
        created = await storage.index.own_blob(principal.namespace, digest)
    return JSONResponse(
        {"digest": digest, "size": size, "created": created},
        status_code=201 if created else 200,
        headers={"etag": f'"{digest}"'},
    )


async def _visible_size(storage: Storage, principal: Principal, digest: str) -> int | None:
    """The blob's size if it exists for this caller's namespace, else None."""
    if principal.namespace is not None and \
            not await storage.index.owns_blob(principal.namespace, digest):
        return None
    return await storage.blobs.stat(digest)


async def _make_room(storage: Storage, size: int, budget: int) -> None:
    """Evict least-recently-used entries if `size` more bytes would break the budget."""
    used = await storage.index.stored_bytes()
    if used + size <= budget:
        return
    settings = storage.settings
    if await storage.index.acquire_lock("gc", ttl_s=120):
        try:
            await eviction.collect(storage, budget=max(0, budget - size),
                                   grace_s=settings.gc_grace_s, low_water=settings.gc_low_water)
        finally:
            await storage.index.release_lock("gc")
        used = await storage.index.stored_bytes()
    if used + size > budget:
        raise InsufficientStorage(
            f"store budget {budget} bytes: {used} used, {size} more do not fit even after "
            "evicting unpinned entries",
            code="store_full", used=used, budget=budget,
        )


@router.head("/{digest}", responses={404: {"description": "not stored"}})
async def head_blob(digest: Digest, storage: StorageDep, principal: Reader) -> Response:
    """Whether a blob is stored (HEAD before PUT lets clients skip uploads)."""
    require_hex64(digest, "digest")
    size = await _visible_size(storage, principal, digest)
    if size is None:
        return Response(status_code=404)
    return Response(status_code=200, headers=_blob_headers(digest, size))


@router.get(
    "/{digest}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}},
               206: {"description": "the requested range"}, 304: {"description": "unchanged"},
               307: {"description": "redirect to a presigned URL (s3_redirect)"},
               **error_responses(404, 416)},
)
async def get_blob(digest: Digest, request: Request, storage: StorageDep,
                   principal: Reader) -> Response:
    """Stream a blob in large chunks; honours `Range` (206) and `If-None-Match` (304)."""
    require_hex64(digest, "digest")
    size = await _visible_size(storage, principal, digest)
    if size is None:
        raise NotFound(f"blob {digest} is not stored", code="blob_not_found")
    headers = _blob_headers(digest, size)
    if request.headers.get("if-none-match") in (f'"{digest}"', "*"):
        return Response(status_code=304, headers={"etag": headers["etag"]})
    presign = getattr(storage.blobs, "presigned_url", None)
    if storage.settings.s3_redirect and presign is not None:
        return RedirectResponse(presign(digest), status_code=307,
                                headers={"etag": headers["etag"]})
    span = None
    if_range = request.headers.get("if-range")
    if if_range is None or if_range == headers["etag"]:
        span = parse_range(request.headers.get("range"), size)
    status = 200
    start, end = 0, size
    if span is not None:
        start, end = span
        status = 206
        headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
        headers["content-length"] = str(end - start)
    return StreamingResponse(
        storage.blobs.read(digest, start, end),
        status_code=status,
        headers=headers,
        media_type="application/octet-stream",
    )
