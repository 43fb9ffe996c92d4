"""The HTTP API's route table: every request the server answers, named once for both sides.

The client builds every URL it calls from here (`Route.url`), the server's app serves
exactly these (a test compares the table with the app's routes and with
`docs/http-api.md`, both ways), so a path cannot drift on one side only.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    """With `{name}` parameters, as the server declares them."""

    def url(self, **params: str) -> str:
        """The path with `params` filled in, each %-encoded whole (a `/` or `..` in a value
        stays inside its segment)."""
        return self.path.format(**{k: quote(str(v), safe="") for k, v in params.items()})


# blobs: the content-addressed store
PUT_BLOB = Route("PUT", "/v1/cas/{digest}")
HEAD_BLOB = Route("HEAD", "/v1/cas/{digest}")
GET_BLOB = Route("GET", "/v1/cas/{digest}")
REPORT_BLOB = Route("POST", "/v1/cas/{digest}/report")
# entries: fingerprint key -> manifest
PUT_ENTRY = Route("PUT", "/v1/ac/{key}")
GET_ENTRY = Route("GET", "/v1/ac/{key}")
LIST_ENTRIES = Route("GET", "/v1/ac")
DELETE_ENTRY = Route("DELETE", "/v1/ac/{key}")
PIN_ENTRY = Route("PUT", "/v1/ac/{key}/pin")
UNPIN_ENTRY = Route("DELETE", "/v1/ac/{key}/pin")
REPORT_ENTRY = Route("POST", "/v1/ac/{key}/report")
# jobs: one resolution per attempt, one publisher per key
RESOLVE_ENTRY = Route("POST", "/v1/ac/{key}/resolve")
CLAIM_PUBLISH = Route("POST", "/v1/ac/{key}/claim")
RELEASE_CLAIM = Route("DELETE", "/v1/ac/{key}/claim")
# events, stats, jobs, trust
POST_EVENTS = Route("POST", "/v1/events")
STATS = Route("GET", "/v1/stats")
JOBS = Route("GET", "/v1/jobs")
JOB_PROGRESS = Route("POST", "/v1/jobs/{job}/progress")
JOB_ETT = Route("GET", "/v1/jobs/{job}/ett")
ETT_TREND = Route("GET", "/v1/ett/trend")
QUARANTINE = Route("GET", "/v1/quarantine")
WHOAMI = Route("GET", "/v1/whoami")
# operators: dashboard, metrics, health, docs
DASHBOARD_PAGE = Route("GET", "/")
DASHBOARD_DATA = Route("GET", "/v1/dashboard")
METRICS = Route("GET", "/metrics")
HEALTHZ = Route("GET", "/healthz")
READYZ = Route("GET", "/readyz")
DOCS = Route("GET", "/docs")
OPENAPI = Route("GET", "/openapi.json")

ROUTES: tuple[Route, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Route))
"""Every route, in the order above."""
