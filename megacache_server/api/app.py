"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from megacache_client.wire.events import Event
from megacache_client.wire.manifest import Manifest
from megacache_client.wire.progress import ProgressBatch
from megacache_client.wire.schema import shown_step
from megacache_client.wire.text import escape_foreign
from megacache_server import __version__
from megacache_server.api import supervisor
from megacache_server.api.docs import add_offline_docs
from megacache_server.api.logs import configure_logging
from megacache_server.api.middleware import HeaderLimit, LocalOnly
from megacache_server.api.redact import redact_access_log
from megacache_server.api.request_metrics import RequestMetrics
from megacache_server.api.route_table import allowed_methods
from megacache_server.api.routes.ac import router as ac_router
from megacache_server.api.routes.cas import router as cas_router
from megacache_server.api.routes.ett import router as progress_router
from megacache_server.api.routes.ett import trend_router
from megacache_server.api.routes.events import router as events_router
from megacache_server.api.routes.health import router as health_router
from megacache_server.api.routes.jobs import router as jobs_router
from megacache_server.api.routes.observability import router as observe_router
from megacache_server.api.routes.trust import router as trust_router
from megacache_server.errors import ApiError, BadRequest, error_body
from megacache_server.service.caching.cache import Cache
from megacache_server.service.ett.roller import Roller
from megacache_server.service.housekeeping.collector import (
    Collector,
    LocalCollector,
    SubprocessCollector,
)
from megacache_server.service.observability.metered import MeteredCollector, MeteredTenantCache
from megacache_server.service.security.signing import check_signing_key
from megacache_server.service.security.trust import Scrubber
from megacache_server.settings import Settings
from megacache_server.store.storage import Storage, build_storage

log = logging.getLogger("megacache.server")

GIL_SWITCH_S = 0.0005
"""How long a worker thread may hold the GIL while the event loop waits for it (CPython's
default: 5 ms). Work runs in threads (SQLite queries, S3 calls through boto3, rendering
/metrics) and the loop gives the GIL up at every socket or SQLite call, so with the default
a lookup served beside such work waits up to 5 ms per hand-over, several per request."""


def create_app(settings: Settings | None = None, storage: Storage | None = None) -> FastAPI:
    """Build the app. Storage is opened at start-up and closed at shutdown."""
    settings = settings or Settings()
    problem = settings.exposure_problem()
    if problem:
        raise RuntimeError(problem)
    check_signing_key(settings)
    # A storage handed in is collected in place; the server's own storage is collected by a
    # child process (collector.py) that opens it from the same settings.
    if storage is None:
        storage = build_storage(settings)
        collector: Collector = SubprocessCollector(settings, storage.index)
    else:
        collector = LocalCollector(settings, storage)
    cache = Cache(settings, storage, MeteredCollector(collector), wrap=MeteredTenantCache)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await storage.open()
        # Everything built so far (FastAPI, pydantic, route schemas: ~70k objects) lives as
        # long as the process. Freezing it keeps full garbage collections, which otherwise
        # walk it about once a second under load and stall every request on the worker for
        # ~20 ms, out of the lookup latency tail.
        gc.collect()
        gc.freeze()
        sys.setswitchinterval(GIL_SWITCH_S)
        tasks = []
        if settings.gc_interval_s > 0:
            tasks.append(asyncio.create_task(_gc_forever(cache)))
        beats = cache.parts.progress.beats
        if beats.flush_s > 0:
            tasks.append(asyncio.create_task(beats.run_forever()))
        if settings.ett_roll_s > 0:  # one process rolls at a time: the rest wait on its lock
            tasks.append(asyncio.create_task(Roller(
                storage.index, settings.ett_roll_s, settings.event_retention_days
            ).run_forever()))
        if settings.scrub_bytes_per_s > 0:  # one process scrubs: the rest wait on its lock
            tasks.append(asyncio.create_task(Scrubber(settings, storage).run_forever()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            try:
                await beats.flush()  # a clean stop loses no buffered heartbeat
            finally:
                await storage.close()

    app = FastAPI(
        title="megacache",
        version=__version__,
        summary="Remote compile cache for PyTorch 2: content-addressed Mega-Cache bundles.",
        lifespan=lifespan,
        redirect_slashes=False,
        docs_url=None,  # add_offline_docs: no CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.cache = cache
    app.include_router(cas_router)
    app.include_router(ac_router)
    app.include_router(jobs_router)
    app.include_router(events_router)
    app.include_router(progress_router)
    app.include_router(trend_router)
    app.include_router(trust_router)
    app.include_router(observe_router)
    app.include_router(health_router)
    add_offline_docs(app)
    _add_error_handlers(app)
    app.add_middleware(HeaderLimit, limit=int(settings.max_header_size))
    if not settings.auth:
        app.add_middleware(LocalOnly, allowed_hosts=frozenset(
            h.strip() for h in settings.allowed_hosts.split(",") if h.strip()))
    app.add_middleware(RequestMetrics, log_requests=settings.log_format == "json")
    configure_logging(settings.log_format, settings.log_level)
    redact_access_log()
    _openapi_with_models(app)
    return app


async def _gc_forever(cache: Cache) -> None:
    """Periodic eviction, garbage collection and event pruning; one replica at a time."""
    while True:
        await asyncio.sleep(cache.settings.gc_interval_s)
        try:
            done = await cache.collect()
            if done is not None and (done.evicted or done.deleted):
                log.info("gc: evicted %d entries, deleted %d blobs, freed %d bytes",
                         done.evicted, done.deleted, done.freed_bytes)
            if done is not None and done.failed:
                log.warning("gc: the blob store could not delete %d blobs; trying again "
                            "next period", done.failed)
        except Exception as exc:  # storage down: try again next period
            log.warning("gc failed: %s", exc)


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` worker processes: settings come from MEGACACHE_*."""
    supervisor.exit_with_supervisor()
    return create_app(Settings())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        try:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except UnicodeEncodeError:  # an error that echoes what UTF-8 cannot carry (#58)
            return JSONResponse(_encodable(exc.body()), status_code=exc.status,
                                headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": [shown_step(s) for s in e["loc"]], "msg": e["msg"], "type": e["type"]}
                  for e in exc.errors()]
        hex_params = [e["loc"][1] for e in exc.errors()
                      if tuple(e["loc"][:1]) in (("path",), ("query",))
                      and e["loc"][1:2] and e["loc"][1] in HEX_PARAMS]
        if hex_params:  # a digest or key of the wrong shape: 400, as the API promises
            name = hex_params[0]
            return await api_error(_, BadRequest(
                f"{name} must be 64 lowercase hex characters (a sha256)",
                code=f"malformed_{name}"))
        body = error_body(422, "invalid_request", "request parameters are invalid",
                          errors=errors)
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = {k: v for k, v in (exc.headers or {}).items()
                   if not (exc.status_code == 405 and k.lower() == "allow")}
        if exc.status_code == 405:  # list every method the path supports, not one route's
            headers["allow"] = ", ".join(allowed_methods(app.router.routes, request.url.path))
        body = error_body(exc.status_code, "http_error", str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=headers)


HEX_PARAMS = ("digest", "key", "env", "hw")


def _encodable(value: Any) -> Any:
    """`value` with every string, key or value, that UTF-8 cannot encode escaped: the
    last guard that keeps a 4xx a 4xx whatever its message quotes."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return escape_foreign(value, 1024)
        return value
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    return value


def _openapi_with_models(app: FastAPI) -> None:
    """Put the shared schemas in components/schemas, where the routes refer to them (pydantic
    reads the rules they are declared with; the routes validate with `schema.parse_json`).

    The routes read their bodies themselves (to give 413/422 their own way), so FastAPI
    does not know these models; without this the spec would carry dangling references.
    """
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = base()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        # pydantic reads the rules of megacache_client.wire.schema
        for model in (Manifest, Event, ProgressBatch):
            spec = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
            components.update(spec.pop("$defs", {}))
            components[model.__name__] = spec
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
