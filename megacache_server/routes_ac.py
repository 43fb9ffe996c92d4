"""`/v1/ac`: the index from fingerprint key to manifest (the "action cache")."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import ValidationError

from megacache_client.manifest import HEX64_PATTERN, Manifest, component_digest
from megacache_server.auth import Forbidden, Principal, require
from megacache_server.errors import (
    FailedDependency,
    NotFound,
    PayloadTooLarge,
    Unprocessable,
    error_responses,
)
from megacache_server.index.base import Precondition, StoredEntry
from megacache_server.signing import signature_headers
from megacache_server.storage import Storage, get_storage
from megacache_server.validation import request_body, require_content_length, require_hex64

router = APIRouter(prefix="/v1/ac", tags=["ac"],
                   responses=error_responses(400, 401, 403, 422, 431, 503))
Key = Annotated[str, Path(pattern=HEX64_PATTERN, description="fingerprint key")]
StorageDep = Annotated[Storage, Depends(get_storage)]
Reader = Annotated[Principal, Depends(require("read"))]
Writer = Annotated[Principal, Depends(require("write"))]
Admin = Annotated[Principal, Depends(require("admin"))]

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
               **error_responses(408, 411, 412, 413, 424)},
)
async def put_entry(key: Key, request: Request, storage: StorageDep,
                    principal: Writer) -> Response:
    """Write the manifest for `key`. Every blob it names must already be stored (424 if not).

    `If-None-Match: *` writes only if absent; `If-Match: <etag>` only over that version.
    """
    require_hex64(key, "key")
    limit = int(storage.settings.max_manifest_size)
    require_content_length(request.headers.get("content-length"), limit, "manifest")
    body = await _read_limited(request, limit)
    manifest = _parse_manifest(body, key)
    namespace = manifest.fingerprint.namespace
    if not principal.sees(namespace):
        raise Forbidden(f"token {principal.name!r} writes namespace {principal.namespace!r}, "
                        f"not {namespace!r}", code="namespace_mismatch")
    await _require_blobs(manifest, storage, principal)
    stored = manifest.to_json()
    fp = manifest.fingerprint
    entry, created = await storage.index.put(
        key,
        stored,
        model=fp.model,
        env_digest=component_digest(fp.env),
        hw_digest=component_digest(fp.hw),
        blob_digests=[b.digest for b in manifest.blobs],
        created_at=manifest.created_at.timestamp(),
        namespace=namespace,
        condition=Precondition(
            if_match=request.headers.get("if-match"),
            if_none_match=request.headers.get("if-none-match"),
        ),
    )
    return _json(stored, 201 if created else 200,
                 _entry_headers(storage, key, namespace, entry.etag, stored))


@router.get("/{key}", responses={
    200: {"content": {"application/json": {"schema": {"$ref": MANIFEST_REF}}}},
    304: {"description": "unchanged"}, **error_responses(404)})
async def get_entry(key: Key, request: Request, storage: StorageDep,
                    principal: Reader) -> Response:
    """The manifest for `key`, with its ETag (and signature, when the server signs)."""
    entry = await _visible_entry(storage, principal, key)
    if request.headers.get("if-none-match") == entry.etag:
        return Response(status_code=304, headers={"etag": entry.etag})
    return _json(entry.manifest_json, headers=_entry_headers(
        storage, key, _namespace_of(entry.manifest_json), entry.etag, entry.manifest_json))


@router.get("", responses={200: {"description": "entries, newest first", "content": {
    "application/json": {"schema": {"type": "object", "required": ["entries"], "properties": {
        "entries": {"type": "array", "items": {"$ref": MANIFEST_REF}}}}}}}})
async def list_entries(
    storage: StorageDep,
    principal: Reader,
    namespace: Annotated[str | None, Query(max_length=64)] = None,
    model: Annotated[str | None, Query(max_length=256)] = None,
    env: Annotated[str | None, Query(pattern=HEX64_PATTERN,
                                     description="component_digest(env)")] = None,
    hw: Annotated[str | None, Query(pattern=HEX64_PATTERN,
                                    description="component_digest(hw)")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> Response:
    """Entries newest first, filtered by model and by env / hw component digests."""
    for value, what in ((env, "env"), (hw, "hw")):
        if value is not None:
            require_hex64(value, what)
    if principal.namespace is not None:
        if namespace is not None and namespace != principal.namespace:
            raise Forbidden(f"token {principal.name!r} reads namespace "
                            f"{principal.namespace!r}, not {namespace!r}",
                            code="namespace_mismatch")
        namespace = principal.namespace
    entries = await storage.index.list_entries(
        model=model, env_digest=env, hw_digest=hw, limit=limit, namespace=namespace
    )
    return _json(b'{"entries":[' + b",".join(e.manifest_json for e in entries) + b"]}")


@router.delete("/{key}", status_code=204, responses=error_responses(404))
async def delete_entry(key: Key, storage: StorageDep, principal: Admin) -> Response:
    """Remove an entry (its blobs stay until garbage collection)."""
    await _visible_entry(storage, principal, key)
    if not await storage.index.delete(key):
        raise NotFound(f"no entry for key {key}", code="entry_not_found")
    return Response(status_code=204)


@router.put("/{key}/pin", status_code=204, responses=error_responses(404))
async def pin_entry(key: Key, storage: StorageDep, principal: Admin) -> Response:
    """Pin an entry: eviction never removes it (nor, so, its blobs)."""
    await _visible_entry(storage, principal, key)
    return await _set_pinned(storage, key, True)


@router.delete("/{key}/pin", status_code=204, responses=error_responses(404))
async def unpin_entry(key: Key, storage: StorageDep, principal: Admin) -> Response:
    """Unpin an entry: it ages out by last access like any other."""
    await _visible_entry(storage, principal, key)
    return await _set_pinned(storage, key, False)


async def _visible_entry(storage: Storage, principal: Principal, key: str) -> StoredEntry:
    """The entry if it exists in the caller's namespace; 404 otherwise (no hint it exists)."""
    require_hex64(key, "key")
    entry = await storage.index.get(key)
    if entry is None or (principal.namespace is not None and
                         not principal.sees(_namespace_of(entry.manifest_json))):
        raise NotFound(f"no entry for key {key}", code="entry_not_found")
    return entry


def _namespace_of(manifest_json: bytes) -> str:
    return str(json.loads(manifest_json)["fingerprint"].get("namespace", "default"))


def _entry_headers(storage: Storage, key: str, namespace: str, etag: str,
                   manifest_json: bytes) -> dict[str, str]:
    return {"etag": etag, **signature_headers(storage.settings, key, namespace, manifest_json)}


async def _set_pinned(storage: Storage, key: str, pinned: bool) -> Response:
    require_hex64(key, "key")
    if not await storage.index.set_pinned(key, pinned):
        raise NotFound(f"no entry for key {key}", code="entry_not_found")
    return Response(status_code=204)


async def _read_limited(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request_body(request):
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"manifest is over {limit} bytes", limit=limit)
    return bytes(body)


def _parse_manifest(body: bytes, key: str) -> Manifest:
    try:
        manifest = Manifest.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise Unprocessable(f"manifest is not valid JSON: {errors[0]['msg']}",
                                code="malformed_json") from None
        raise Unprocessable(
            "manifest does not match the schema",
            code="invalid_manifest",
            errors=[{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                    for e in errors],
        ) from None
    if manifest.key != key:
        raise Unprocessable(f"manifest key {manifest.key} differs from the URL key {key}",
                            code="key_mismatch")
    return manifest


async def _require_blobs(manifest: Manifest, storage: Storage, principal: Principal) -> None:
    """Every named blob must be stored (and visible to the writer's namespace). Touching them
    first keeps garbage collection, which spares recently touched blobs, from deleting one
    between this check and the write."""
    await storage.index.touch_blobs([b.digest for b in manifest.blobs])
    missing, wrong_size = [], []
    for blob in manifest.blobs:
        size = await storage.blobs.stat(blob.digest)
        if size is not None and principal.namespace is not None and \
                not await storage.index.owns_blob(principal.namespace, blob.digest):
            size = None
        if size is None:
            missing.append(blob.digest)
        elif size != blob.size:
            wrong_size.append({"digest": blob.digest, "declared": blob.size, "stored": size})
    if missing:
        raise FailedDependency(
            f"{len(missing)} blob(s) named by the manifest are not stored; upload them first",
            missing=missing,
        )
    if wrong_size:
        raise Unprocessable("blob sizes in the manifest differ from the stored blobs",
                            code="size_mismatch", blobs=wrong_size)

