"""The job side of `RemoteCache`: what a run tells the server and what it reads back.

Not the cache path: a finding (bad bytes met, so the server stops serving them to the
fleet), a run's event, a job's progress for Effective Training Time, and the reads the
`megacache` command and the dashboard make of them (stats, jobs, a job's ETT, the trend);
with them the two questions about the server itself (is it there, who am I to it). Kept
apart from the entries and blobs so that the cache's calls are read without these.
"""

from __future__ import annotations

from typing import Any

from megacache_client.errors import Finding, TransportError
from megacache_client.transport.exchange import Exchange
from megacache_client.wire import routes
from megacache_client.wire.escape import escape
from megacache_client.wire.text import as_text


class ReportingRoutes(Exchange):
    """Reports, events, progress and the reads of them; health and identity."""

    def reachable(self) -> bool:
        """Whether the server answers at all (`/healthz`, within this client's deadline):
        asked before work that only the server can use (a publish round's packs)."""
        try:
            return self._exchange(routes.HEALTHZ, "health check").status < 500
        except TransportError:
            return False

    def whoami(self) -> tuple[str, list[str]]:
        """This client's token name and scopes, as the server knows them."""
        a = self._exchange(routes.WHOAMI, "whoami")
        self._expect(a, (200,), "whoami")
        data = a.json()
        return escape(data["name"], 128), [escape(s, 64) for s in data["scopes"]][:16]

    # -- reports: bad bytes met ---------------------------------------------------------
    def report(self, finding: Finding, job: str | None = None) -> str:
        """Tell the server what this client met; returns its verdict ("ok", "quarantined",
        "counted", "withdrawn"). A blob is reported by digest (the server re-hashes it);
        torch failing on a bundle whose blobs all verified, by entry."""
        detail = as_text(finding.detail, 500)
        if finding.digest is not None:
            what = "report blob"
            a = self._exchange(routes.REPORT_BLOB, what, digest=finding.digest, json={
                "kind": finding.kind, "detail": detail, "entry_key": finding.entry_key})
        elif finding.entry_key is not None:
            what = "report entry"
            a = self._exchange(routes.REPORT_ENTRY, what, key=finding.entry_key, json={
                "kind": finding.kind, "detail": detail, "job": job})
        else:
            raise ValueError("a finding names a blob or an entry")
        self._expect(a, (200,), what)
        try:
            return escape(a.json()["verdict"], 32)
        except (ValueError, KeyError, TypeError):
            return "answered"

    # -- events, progress and the reads of them ------------------------------------------
    def post_event(self, event: dict[str, Any]) -> None:
        a = self._exchange(routes.POST_EVENTS, "post event", json=event)
        self._expect(a, (200, 201, 202), "post event")

    def post_progress(self, job: str, batch: bytes) -> None:
        """Send a job's progress (a `wire.progress.ProgressBatch` as JSON)."""
        a = self._exchange(routes.JOB_PROGRESS, "post progress", content=batch,
                           headers={"content-type": "application/json"}, job=job)
        self._expect(a, (200, 201, 202, 204), "post progress")

    def stats(self) -> dict[str, Any]:
        return dict(self._listing(routes.STATS, "stats"))

    def jobs(self, *, limit: int = 50) -> list[dict[str, Any]]:
        """The namespace's jobs that reported last, each with its ETT split (`ett`)."""
        return list(self._listing(routes.JOBS, "jobs", params={"limit": limit})["jobs"])

    def job_ett(self, job: str) -> dict[str, Any]:
        """One job's Effective Training Time, per attempt (docs/ett.md)."""
        return dict(self._listing(routes.JOB_ETT, "job ETT", job=job))

    def ett_trend(self, **params: Any) -> dict[str, Any]:
        """The namespace's ETT per day or hour (`days`, `period`, `model`: docs/ett.md)."""
        return dict(self._listing(routes.ETT_TREND, "ETT trend", params=params))
