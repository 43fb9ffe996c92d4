"""The entry routes of `RemoteCache`: get, resolve, claim, list and put an entry.

An entry is the small signed manifest a fingerprint key names; everything a trainer loads
starts from one, so these calls hand entries out only through the gate (`trust.Gate`:
signature, writer policy, key, rollback). A listing is a nomination, never loaded as is.
Kept apart from the blobs' streaming and the job side's reports so that the rules an entry
passes read in one place.
"""

from __future__ import annotations

import logging
from typing import Any

from megacache_client.errors import TransportError
from megacache_client.transport import reader
from megacache_client.transport.exchange import Exchange
from megacache_client.transport.trust import ServedEntry
from megacache_client.wire import headers as wire_headers
from megacache_client.wire import routes
from megacache_client.wire.escape import escape
from megacache_client.wire.manifest import Manifest, component_digest
from megacache_client.wire.schema import SchemaError, parse
from megacache_client.wire.text import escape_foreign


class ResolutionUnsupported(TransportError):
    """The server has no job resolutions: the process decides alone."""


class EntryRoutes(Exchange):
    """The index: which manifest a key means, who publishes it, and writing one."""

    def get_entry(self, entry_key: str) -> ServedEntry | None:
        """The entry at `entry_key`, through the gate; None when there is none."""
        a = self._exchange(routes.GET_ENTRY, "get entry", cap=reader.MANIFEST_JSON,
                           key=entry_key)
        if a.status == 404:
            return None
        self._expect(a, (200,), "get entry")
        return self.gate.entry(entry_key, a.body, a.headers)

    def resolve_entry(self, entry_key: str, *, job: str, attempt: int, ttl_s: float,
                      fallback: dict[str, str] | None = None) -> ServedEntry | None:
        """The entry `entry_key` means for this job attempt (None: the attempt resolved it
        to a miss), the same for every rank whatever is published meanwhile.

        The answer may be another key's manifest only when a fallback rule was sent: the
        server chose the stand-in once for the attempt. The signature covers the key asked.
        """
        body: dict[str, Any] = {"job": job, "attempt": attempt, "ttl_s": ttl_s}
        if fallback is not None:
            body["fallback"] = fallback
        a = self._exchange(routes.RESOLVE_ENTRY, "resolve entry", cap=reader.MANIFEST_JSON,
                           json=body, key=entry_key)
        if a.status == 404 and a.headers.get(wire_headers.RESOLUTION) == "miss":
            return None
        if a.status in (404, 405):  # a server from before job resolutions
            raise ResolutionUnsupported(
                "the server does not resolve job attempts (an older version): each process "
                "decided alone", a.status)
        self._expect(a, (200,), "resolve entry")
        return self.gate.entry(entry_key, a.body, a.headers, fallback=fallback is not None,
                               job=(job, attempt))

    def claim(self, entry_key: str, *, holder: str, lease_s: float) -> str | None:
        """Claim the publish of `entry_key`: None when granted, else who holds it."""
        a = self._exchange(routes.CLAIM_PUBLISH, "claim publish", key=entry_key,
                           json={"holder": holder, "lease_s": lease_s})
        if a.status == 409:
            try:
                return escape(a.json()["error"]["holder"], 128)
            except (ValueError, KeyError, TypeError):
                return "another publisher"
        if a.status in (404, 405):  # a server from before claims: publish as before
            return None
        self._expect(a, (200,), "claim publish")
        return None

    def release_claim(self, entry_key: str, *, holder: str) -> None:
        a = self._exchange(routes.RELEASE_CLAIM, "release claim", key=entry_key,
                           params={"holder": holder})
        self._expect(a, (204, 404, 405, 409), "release claim")

    def list_entries(self, *, model: str | None = None, env: dict[str, Any] | None = None,
                     hw: dict[str, Any] | None = None, limit: int = 20) -> list[Manifest]:
        """Entries of the namespace, newest first: nominations only. A listing is not
        signed; what is loaded is fetched again by key, through the gate."""
        params: dict[str, Any] = {"limit": limit}
        if model is not None:
            params["model"] = model
        if env is not None:
            params["env"] = component_digest(env)
        if hw is not None:
            params["hw"] = component_digest(hw)
        if self.config.trusted_writers:
            params["writers"] = self.config.trusted_writers
        entries: list[Manifest] = []
        for e in self._listing(routes.LIST_ENTRIES, "list entries", params=params)["entries"]:
            try:
                entries.append(parse(Manifest, e))
            except SchemaError as exc:  # stored before the text rule, or a hostile server
                logging.getLogger("megacache").warning(
                    "megacache: a listed entry is skipped: %s", escape_foreign(exc, 200))
        return entries

    def put_entry(self, manifest: Manifest, *, if_match: str | None = None,
                  if_none_match: str | None = None) -> str | None:
        """Write an entry; None when the precondition failed (someone else wrote first)."""
        headers = {"content-type": "application/json"}
        if if_match:
            headers["if-match"] = if_match
        if if_none_match:
            headers["if-none-match"] = if_none_match
        a = self._exchange(routes.PUT_ENTRY, "put entry", cap=reader.MANIFEST_JSON,
                           content=manifest.to_json(), headers=headers, key=manifest.key)
        if a.status == 412:
            return None
        self._expect(a, (200, 201), "put entry")
        return a.headers.get("etag", "")
