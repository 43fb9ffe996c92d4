"""Bearer tokens with scopes and a namespace each.

A bundle is code a trainer will execute (Mega-Cache payloads are pickles), so who may write
matters more than who may read. Tokens look like `mc_<id>_<secret>`; the server stores only
the sha256 of the whole token, finds the record by id and compares hashes in constant time.
Scopes: `read` (GET/HEAD, listings, stats), `write` (uploads, manifests, events),
`admin` (delete, pin, everything in its namespace, and the server-wide figures of
`/metrics`), `metrics` (a scrape token: `/metrics` of every namespace, nothing else). A
token sees only its own namespace: entries of other namespaces do not exist for it, and
neither do blobs it never uploaded (the CAS dedupes bytes underneath, but a reader cannot
probe for content another team stored).

With auth off (the embedded default, loopback only) every request acts as an anonymous
admin that sees all namespaces. Reading the header off a request is the API's part
(`api.deps`); who the token names and what it may do are decided here.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Literal

from megacache_client.wire.manifest import NAMESPACE_PATTERN
from megacache_server.errors import Forbidden, Unauthorized
from megacache_server.settings import Settings
from megacache_server.store.index.base import TokenRecord, TokenStore

Scope = Literal["read", "write", "admin", "metrics"]
SCOPES: tuple[Scope, ...] = ("read", "write", "admin", "metrics")


@dataclass(frozen=True)
class Principal:
    """Who a request acts as, and the one place namespace visibility is decided: a token of
    namespace B reads, lists, counts and reports only within B; auth off sees them all."""

    name: str
    scopes: frozenset[str]
    namespace: str | None  # None: every namespace (auth off)
    token_id: str = ""  # "" with auth off

    @property
    def home(self) -> str:
        """The namespace this caller's writes (blobs, events, job records) belong to."""
        return self.namespace or "default"

    @property
    def caller_id(self) -> str:
        """What limits and report counts key on: the token (the name with auth off, where
        there is one caller)."""
        return self.token_id or self.name

    @property
    def sees_server(self) -> bool:
        """Whether this caller may read figures of the whole server (HTTP traffic, what
        every worker served, the store's size): the operator (auth off), a `metrics` scrape
        token, or an `admin` token. Any other reader sees its own namespace's series only:
        server-wide counters move with every tenant's requests."""
        return self.namespace is None or not self.scopes.isdisjoint(("admin", "metrics"))

    def sees(self, namespace: str) -> bool:
        return self.namespace is None or self.namespace == namespace

    def confined(self, namespace: str | None, verb: str) -> str | None:
        """The namespace a read or write asks for, this caller's own when it names none
        (None: all, auth off); 403 for one it may not `verb`."""
        if namespace is None or self.sees(namespace):
            return namespace if namespace is not None else self.namespace
        raise Forbidden(f"token {self.name!r} {verb} namespace {self.namespace!r}, "
                        f"not {namespace!r}", code="namespace_mismatch")


ANONYMOUS = Principal("anonymous", frozenset(SCOPES), None)


def new_token(name: str, scopes: tuple[str, ...], namespace: str,
              expires_in_s: float | None = None) -> tuple[str, TokenRecord]:
    """A fresh token (shown once) and the record to store (its hash only).

    The namespace must be one a fingerprint can carry: a token for any other name would
    see nothing and could write nothing, which is never what was meant.
    """
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}; got {', '.join(scopes)}")
    if not re.fullmatch(NAMESPACE_PATTERN, namespace):
        raise ValueError(f"namespace {namespace!r} is not valid: 1-64 of a-z 0-9 _ . - "
                         "starting with a letter or digit")
    if expires_in_s is not None and expires_in_s <= 0:
        raise ValueError("a token's lifetime must be positive")
    token_id = secrets.token_hex(8)
    token = f"mc_{token_id}_{secrets.token_urlsafe(32)}"
    now = time.time()
    return token, TokenRecord(token_id, name, hash_token(token), tuple(scopes), namespace,
                              now, expires_at=None if expires_in_s is None
                              else now + expires_in_s)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90m`, `45s`, `2w` or plain seconds, as seconds (ValueError if not)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration: use e.g. 30d, 12h, 90m or seconds")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


_cache: dict[str, tuple[float, TokenRecord | None]] = {}


async def _lookup(tokens: TokenStore, token_id: str, cache_s: float) -> TokenRecord | None:
    """Token records are cached `cache_s` per process: revocation lags by that much."""
    now = time.monotonic()
    hit = _cache.get(token_id)
    if hit is not None and now - hit[0] < cache_s:
        return hit[1]
    record = await tokens.get_token(token_id)
    if len(_cache) > 10_000:
        _cache.clear()
    _cache[token_id] = (now, record)
    return record


async def authenticate(settings: Settings, tokens: TokenStore, authorization: str
                       ) -> Principal:
    """Who an `Authorization` header value names (401 when nobody valid)."""
    if not settings.auth:
        return ANONYMOUS
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token: send `Authorization: Bearer mc_...`",
                           headers={"www-authenticate": "Bearer"})
    parts = token.strip().split("_")
    record = await _lookup(tokens, parts[1], settings.token_cache_s) \
        if len(parts) >= 3 and parts[0] == "mc" else None
    if record is None or record.revoked or \
            not hmac.compare_digest(record.token_hash, hash_token(token.strip())):
        raise Unauthorized("invalid or revoked token", code="invalid_token",
                           headers={"www-authenticate": 'Bearer error="invalid_token"'})
    if record.expired(time.time()):
        raise Unauthorized("token expired", code="token_expired",
                           headers={"www-authenticate": 'Bearer error="invalid_token", '
                                                        'error_description="expired"'})
    return Principal(record.name, frozenset(record.scopes), record.namespace, record.token_id)


def authorize(principal: Principal, scope: Scope) -> Principal:
    """The principal a request needing `scope` acts as; 403 unless it holds the scope (or
    admin). A `metrics` token scrapes every namespace; any reader scrapes its own."""
    if scope == "metrics":
        if "metrics" in principal.scopes:  # the operator's scrape: every namespace
            return Principal(principal.name, principal.scopes, None, principal.token_id)
        scope_held = "read"  # any reader scrapes its own namespace's series
    else:
        scope_held = scope
    if scope_held not in principal.scopes and "admin" not in principal.scopes:
        raise Forbidden(f"token {principal.name!r} lacks the {scope_held!r} scope",
                        code="missing_scope", required=scope_held,
                        granted=sorted(principal.scopes))
    return principal
