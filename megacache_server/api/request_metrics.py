"""Per-request metrics and the access log, as one ASGI middleware, plus the `/metrics`
rendering of them.

Per-request numbers (requests, latency, bytes) are counted in each worker process; with
several uvicorn workers they go through prometheus_client's multiprocess mode (the CLI
sets PROMETHEUS_MULTIPROC_DIR before workers start). Cache-level numbers come from
`service.observability.metrics`, read from the index's running totals at scrape time, so
they are the same whichever worker or replica answers; what a worker served is counted by
the decorators of `service.observability.metered`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUESTS = Counter("megacache_http_requests_total", "HTTP requests answered",
                   ["method", "route", "status"])
LATENCY = Histogram("megacache_http_request_duration_seconds", "Time to answer a request",
                    ["method", "route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                             5, 10, 30, 60))
BYTES_IN = Counter("megacache_http_received_bytes_total", "Request body bytes", ["route"])
BYTES_OUT = Counter("megacache_http_sent_bytes_total", "Response body bytes", ["route"])

access_log = logging.getLogger("megacache.access")


class RequestMetrics:
    """Counts, times and (in JSON mode) logs every HTTP request; tags it with a request id."""

    def __init__(self, app: ASGIApp, log_requests: bool) -> None:
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] \
            or uuid.uuid4().hex[:16]
        state = {"status": 500, "sent": 0, "received": 0}

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
            return message

        async def tagging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode("latin-1"))]
            elif message["type"] == "http.response.body":
                state["sent"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, tagging_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"]
            duration = time.perf_counter() - started
            REQUESTS.labels(method, route, str(state["status"])).inc()
            LATENCY.labels(method, route).observe(duration)
            BYTES_IN.labels(route).inc(state["received"])
            BYTES_OUT.labels(route).inc(state["sent"])
            if self.log_requests:
                access_log.info("request", extra={"fields": {
                    "request_id": request_id, "method": method, "route": route,
                    "path": scope["path"], "status": state["status"],
                    "bytes_in": state["received"], "bytes_out": state["sent"],
                    "duration_ms": round(duration * 1000, 2),
                    "client": (scope.get("client") or ("", 0))[0]}})


def render_process_metrics() -> bytes:
    """This process's metrics, or all workers' in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest(REGISTRY)


__all__ = ["CONTENT_TYPE_LATEST", "RequestMetrics", "render_process_metrics"]
