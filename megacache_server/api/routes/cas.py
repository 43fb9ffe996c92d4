"""`/v1/cas/{digest}`: immutable blobs addressed by their sha256."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse

from megacache_client.wire.manifest import HEX64_PATTERN
from megacache_server.api.deps import Reader, Writer
from megacache_server.api.ranges import parse_range
from megacache_server.api.validation import request_body, require_content_length
from megacache_server.errors import NotFound, error_responses
from megacache_server.service.security.signing import redirect_headers

router = APIRouter(prefix="/v1/cas", tags=["cas"],
                   responses=error_responses(400, 401, 403, 431, 503))
Digest = Annotated[str, Path(pattern=HEX64_PATTERN, description="sha256 of the blob")]

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
async def put_blob(digest: Digest, request: Request, cache: Writer) -> JSONResponse:
    """Upload a blob; the body must hash to `digest`. Idempotent."""
    size = require_content_length(
        request.headers.get("content-length"), int(cache.settings.max_blob_size), "blob")
    created = await cache.put_blob(digest, size, request_body(request))
    return JSONResponse(
        {"digest": digest, "size": size, "created": created},
        status_code=201 if created else 200,
        headers={"etag": f'"{digest}"'},
    )


@router.head("/{digest}", responses={404: {"description": "not stored"}})
async def head_blob(digest: Digest, cache: Reader) -> Response:
    """Whether a blob is stored (HEAD before PUT lets clients skip uploads)."""
    size = await cache.recorded_blob_size(digest)
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
async def get_blob(digest: Digest, request: Request, cache: Reader) -> Response:
    """Stream a blob in large chunks; honours `Range` (206) and `If-None-Match` (304)."""
    size = await cache.blob_size(digest)
    if size is None:
        raise NotFound(f"blob {digest} is not stored", code="blob_not_found")
    headers = _blob_headers(digest, size)
    if request.headers.get("if-none-match") in (f'"{digest}"', "*"):
        return Response(status_code=304, headers={"etag": headers["etag"]})
    url = cache.presigned_url(digest)
    if url is not None:
        return RedirectResponse(url, status_code=307, headers={
            "etag": headers["etag"], **redirect_headers(cache.settings, url)})
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
    return StreamingResponse(cache.read_blob(digest, start, end), status_code=status,
                             headers=headers, media_type="application/octet-stream")
