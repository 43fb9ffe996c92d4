"""The hostile harness, driven by the code: every route the app serves, attacked.

The routes come from the app itself (`served(app.router.routes)`, which the wire test holds
equal to `megacache_client.wire.routes.ROUTES`), and `CASES` must name each one: a new route
without a case fails `test_every_route_the_app_serves_has_a_hostile_case`. Every case is
then sent, through a real server on each backend pair, with auth on:

- no token, a token without the route's scope, and a %-encoded token (in the header, the
  query and the path): 401 / 403, never the answer;
- another tenant's ids (its keys, blobs, job and holder ids): nothing of it is seen or
  changed (404 / 403, or the caller's own namespace's answer);
- bodies over their limit and bodies that never end: 411 / 413 within seconds (routes that
  take no body answer as usual, without reading it);
- NaN, infinities and huge numbers in every JSON field and query parameter that takes a
  number: 422.

Each answer is a clear 4xx (a JSON error, where the answer has a body) or the route's own
answer, never a 5xx; and at the end the server's log holds no traceback and no token, the
victim's data is as it was, and the attacker's own namespace holds nothing the attacks
stored. tests/test_hostile_input.py, test_bad_input.py and test_schema_fuzz.py keep their
deeper cases (ranges, stalled uploads, schema fuzzing); this file covers the breadth.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import time
import types
import typing
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import LOOPBACK, ServerProcess, make_fingerprint, make_manifest, sha256

from megacache_client.wire.events import Event
from megacache_client.wire.manifest import MANIFEST_FORMAT, Fingerprint, Manifest, sha256_hex
from megacache_client.wire.progress import ProgressBatch
from megacache_client.wire.schema import parse
from megacache_server.api.app import create_app
from megacache_server.api.route_table import served
from megacache_server.api.routes.jobs import ClaimRequest, ResolveRequest
from megacache_server.api.routes.trust import BlobReport, EntryReport
from megacache_server.settings import Settings

MAX_BLOB = 1024 * 1024
NUMBERS = ("NaN", "Infinity", "-Infinity", "1e999", "9" * 5000)
"""What a number is replaced with, as raw JSON text or a query value."""


@dataclass(frozen=True)
class Case:
    """How to call one route: the scope it needs ("public": none), its body, where it takes
    numbers, and what another tenant's ids get (the status, and why when it is not 4xx)."""

    scope: str
    target: str  # the path with {key} / {digest} left to fill, and any query
    body: str = ""  # "", "blob", "manifest", "event", or the name of a JSON body in BODIES
    numbers: tuple[str, ...] = ()  # "?param" query parameters (a JSON body's: its schema's)
    other: int = 404  # the status another tenant's ids get
    limit: int = 0  # the body limit in bytes (413 past it)


BODIES: dict[str, dict[str, Any]] = {
    "resolve": {"job": "attack", "attempt": 0, "ttl_s": 60.0},
    "claim": {"holder": "attacker", "lease_s": 60.0},
    "report_blob": {"kind": "digest", "detail": "attack"},
    "report_entry": {"kind": "load", "detail": "attack"},
    "progress": {"attempt": 0, "records": [
        {"kind": "start", "at": time.time(), "allocation_start": time.time() - 60},
        {"kind": "checkpoint_save", "at": time.time(), "step": 1, "blocking_s": 1.0,
         "background_s": 2.0}]},
}
VICTIM_PROGRESS = [{"kind": "start", "at": time.time() - 100},
                   {"kind": "training", "at": time.time() - 90},
                   {"kind": "end", "at": time.time(), "reason": "finished"}]
EVENT = {"key": "b" * 64, "model": "attack", "outcome": "hit", "compile_s": 1.0,
         "cold_compile_s": 30.0, "saved_s": 29.0, "bytes_down": 10}

CASES: dict[tuple[str, str], Case] = {
    ("PUT", "/v1/cas/{digest}"): Case("write", "/v1/cas/{digest}", "blob", other=400,
                                      limit=MAX_BLOB),
    ("HEAD", "/v1/cas/{digest}"): Case("read", "/v1/cas/{digest}"),
    ("GET", "/v1/cas/{digest}"): Case("read", "/v1/cas/{digest}"),
    ("POST", "/v1/cas/{digest}/report"): Case("read", "/v1/cas/{digest}/report", "report_blob",
                                              limit=4096),
    ("PUT", "/v1/ac/{key}"): Case("write", "/v1/ac/{key}", "manifest", other=403,
                                  limit=64 * 1024),
    ("GET", "/v1/ac/{key}"): Case("read", "/v1/ac/{key}"),
    ("GET", "/v1/ac"): Case("read", "/v1/ac?namespace={namespace}", numbers=("?limit",),
                            other=403),
    ("DELETE", "/v1/ac/{key}"): Case("admin", "/v1/ac/{key}"),
    ("PUT", "/v1/ac/{key}/pin"): Case("admin", "/v1/ac/{key}/pin"),
    ("DELETE", "/v1/ac/{key}/pin"): Case("admin", "/v1/ac/{key}/pin"),
    ("POST", "/v1/ac/{key}/report"): Case("read", "/v1/ac/{key}/report", "report_entry",
                                          limit=4096),
    # the attacker's own namespace's record of the key: a miss (it cannot see the entry)
    ("POST", "/v1/ac/{key}/resolve"): Case("read", "/v1/ac/{key}/resolve", "resolve",
                                           limit=4096),
    # claims are the caller's namespace's: the attacker claims its own key, the victim's
    # claim of the same key stands (checked at the end)
    ("POST", "/v1/ac/{key}/claim"): Case("write", "/v1/ac/{key}/claim", "claim",
                                         other=200, limit=4096),
    ("DELETE", "/v1/ac/{key}/claim"): Case("write", "/v1/ac/{key}/claim?holder={holder}",
                                           other=204),
    # recorded in the attacker's namespace whatever it names (the victim's stats unchanged)
    ("POST", "/v1/events"): Case("write", "/v1/events", "event", other=202,
                                 limit=16 * 1024),
    ("GET", "/v1/stats"): Case("read", "/v1/stats", numbers=("?since_hours",), other=200),
    ("GET", "/v1/jobs"): Case("read", "/v1/jobs", numbers=("?limit",), other=200),
    # a job id names a job of the caller's namespace: the attacker's own (none here)...
    ("GET", "/v1/jobs/{job}/ett"): Case("read", "/v1/jobs/{job}/ett", numbers=("?since",)),
    # ... and what it reports is recorded there (the victim's job of that id unchanged)
    ("POST", "/v1/jobs/{job}/progress"): Case(
        "write", "/v1/jobs/{job}-2/progress", "progress", other=202, limit=128 * 1024),
    # the caller's namespace's rollups only (the victim's rows unseen: checked at the end)
    ("GET", "/v1/ett/trend"): Case("read", "/v1/ett/trend", numbers=("?days",), other=200),
    ("GET", "/v1/quarantine"): Case("read", "/v1/quarantine", numbers=("?limit",),
                                    other=200),
    ("GET", "/v1/whoami"): Case("read", "/v1/whoami", other=200),
    ("GET", "/metrics"): Case("metrics", "/metrics", other=200),
    ("GET", "/v1/dashboard"): Case("read", "/v1/dashboard", numbers=("?hours",), other=200),
    ("GET", "/"): Case("public", "/", other=200),
    ("GET", "/healthz"): Case("public", "/healthz", other=200),
    ("GET", "/readyz"): Case("public", "/readyz", other=200),
    ("GET", "/docs"): Case("public", "/docs", other=200),
    ("GET", "/openapi.json"): Case("public", "/openapi.json", other=200),
    ("MOUNT", "/docs/assets"): Case("public", "/docs/assets/swagger-ui.css", other=200),
}


SCHEMAS: dict[str, type] = {
    "manifest": Manifest, "event": Event, "progress": ProgressBatch,
    "resolve": ResolveRequest, "claim": ClaimRequest, "report_blob": BlobReport,
    "report_entry": EntryReport}
"""The class each JSON body parses as, where the server parses it: the attacks on its fields
come from these (`schema_fields`), not from a hand list."""
TEXTS = ('"a\\ud800b"', '"a\\u001b[2Jb"', '"a\\nb"', '"a\\rb"', '"a\\u0000b"',
         '"a\\u202eb"')
"""What a text field is replaced with, as raw JSON text: a lone surrogate, ESC, LF, CR, NUL,
a right-to-left override (#58)."""


def _hints(cls: type) -> dict[str, Any]:
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls, include_extras=True)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    fields: dict[str, Any] = cls.model_fields  # type: ignore[attr-defined]  # pydantic
    return {name: f.annotation for name, f in fields.items()}


def _arms(hint: Any) -> list[Any]:
    """The types a field's value may have: Annotated and Optional unwrapped."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _arms(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(hint) if arg is not type(None)
                for t in _arms(arg)]
    return [hint]


def _kind(t: Any) -> str:
    if t is bool:
        return "bool"
    if t in (int, float):
        return "number"
    if t in (str, datetime) or typing.get_origin(t) is typing.Literal:
        return "text"
    if dataclasses.is_dataclass(t) or hasattr(t, "model_fields"):
        return "schema"
    return {list: "list", dict: "dict"}.get(typing.get_origin(t), "other")


def schema_fields(cls: type, doc: Any, prefix: str = "") -> tuple[list[str], list[str]]:
    """(number paths, text paths) of `doc`, a valid body of `cls`, by `cls`'s own fields:
    every field of a number or text type (absent optional ones too), into nested schemas,
    list items and dict values the body holds."""
    numbers: list[str] = []
    texts: list[str] = []

    def visit(t: Any, value: Any, path: str) -> None:
        kind = _kind(t)
        if kind in ("number", "text"):
            (numbers if kind == "number" else texts).append(path)
        elif kind == "schema" and isinstance(value, dict):
            more = schema_fields(t, value, path + ".")
            numbers.extend(more[0])
            texts.extend(more[1])
        elif kind == "list" and isinstance(value, list):
            (item,) = typing.get_args(t)
            for i, v in enumerate(value):
                for arm in _arms(item):
                    visit(arm, v, f"{path}.{i}")
        elif kind == "dict" and isinstance(value, dict):
            _, item = typing.get_args(t)
            for k, v in value.items():
                if "." not in k:
                    for arm in _arms(item):
                        visit(arm, v, f"{path}.{k}")

    for name, hint in _hints(cls).items():
        for arm in _arms(hint):
            visit(arm, doc.get(name), prefix + name)
    return list(dict.fromkeys(numbers)), list(dict.fromkeys(texts))


def test_the_schema_walk_finds_the_fields_a_hand_list_missed() -> None:
    """The progress route's `background_s` and `allocation_start` were never attacked
    while the numbers were a hand list per route; derived from the schema they are, and
    every field of every JSON body is either a number, text, bool or a nested schema."""
    numbers, texts = schema_fields(ProgressBatch, BODIES["progress"])
    assert {"attempt", "records.0.allocation_start", "records.1.background_s",
            "records.1.data_wait_s", "records.0.at"} <= set(numbers), numbers
    assert {"model", "records.0.kind", "records.1.reason"} <= set(texts), texts
    for kind, cls in SCHEMAS.items():
        for name, hint in _hints(cls).items():
            assert all(_kind(arm) != "other" for arm in _arms(hint)), (kind, name, hint)


def test_every_route_the_app_serves_has_a_hostile_case(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path))
    routes = {(method, path) for method, path, _ in served(app.router.routes)}
    assert routes - CASES.keys() == set(), "routes without a hostile case in CASES"
    assert CASES.keys() - routes == set(), "cases of routes the app no longer serves"


def _method(route: tuple[str, str]) -> str:
    return "GET" if route[0] == "MOUNT" else route[0]


ROUTES = sorted(CASES)
BODY_ROUTES = [r for r in ROUTES if CASES[r].body]
GUARDED = [r for r in ROUTES if CASES[r].scope != "public"]


# -- the server, the victim and the attacker ---------------------------------------------
@pytest.fixture(scope="module", params=BACKENDS)
def hostile(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("hostile") / "data", *args, "--auth",
        "--max-blob-size", str(MAX_BLOB), log_level="info",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_REPORT_BURST": "1000",
             "MEGACACHE_VIEW_BURST": "1000",
             "MEGACACHE_ETT_ROLL_S": "0.5",
             "MEGACACHE_UPLOAD_IDLE_TIMEOUT_S": "5", "MEGACACHE_MIN_UPLOAD_GRACE_S": "3"}),
        request.param, args).start()
    yield proc
    proc.stop()


@dataclass
class World:
    """The victim's objects (what the attacker aims at) and the attacker's tokens."""

    server: ServerProcess
    victim: str
    secret_model: str
    key: str
    digest: str
    manifest: bytes
    job: str = "victim-job"
    holder: str = "victim-holder"
    tokens: dict[str, str] = field(default_factory=dict)  # scope set -> attacker's token
    victim_token: str = ""
    attacker: str = ""

    def fill(self, target: str, **extra: str) -> str:
        return target.format(key=self.key, digest=self.digest, holder=self.holder,
                             namespace=self.victim, job=self.job, **extra)

    def token_for(self, scope: str) -> str:
        """An attacker's token that holds `scope` (a reader for the public routes)."""
        return self.tokens[{"read": "read", "write": "read,write", "admin": "admin",
                            "metrics": "read", "public": "read"}[scope]]

    def token_without(self, scope: str) -> str:
        """An attacker's token that lacks `scope` (and admin)."""
        return self.tokens[{"read": "write", "write": "read", "admin": "read,write",
                            "metrics": "write", "public": "write"}[scope]]


@pytest.fixture(scope="module")
def world(hostile: ServerProcess) -> World:
    n = os.urandom(3).hex()
    victim, attacker = f"victim-{n}", f"attacker-{n}"
    token = hostile.token("read,write,admin", namespace=victim, name=f"v-{n}")
    auth = {"authorization": f"Bearer {token}"}
    data = os.urandom(5000)
    secret_model = f"secret-model-{n}"
    m = make_manifest({"megacache": data}, make_fingerprint(model=secret_model,
                                                            namespace=victim))
    with httpx.Client(base_url=hostile.url, headers=auth, timeout=30) as c:
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
        assert c.post("/v1/events", json={**EVENT, "model": secret_model}).status_code == 202
        assert c.post(f"/v1/ac/{m.key}/resolve", json={"job": "victim-job"}).status_code \
            == 200
        assert c.post(f"/v1/ac/{m.key}/claim", json={"holder": "victim-holder"}) \
            .status_code == 200
        for job in ("victim-job", "victim-job-2"):
            assert c.post(f"/v1/jobs/{job}/progress", json={"attempt": 0, "model": secret_model,
                                                            "records": VICTIM_PROGRESS}) \
                .status_code == 202
    w = World(hostile, victim, secret_model, m.key, sha256(data), m.to_json(),
              victim_token=token, attacker=attacker)
    for scopes in ("read", "write", "read,write", "admin"):
        w.tokens[scopes] = hostile.token(scopes, namespace=attacker,
                                         name=f"a-{scopes.replace(',', '-')}-{n}")
    return w


# -- sending ---------------------------------------------------------------------------
def _exchange(port: int, method: str, target: str, headers: dict[str, str],
              body: bytes | None = None, *, endless: bool = False,
              deadline_s: float = 15.0) -> tuple[int, dict[str, str], bytes, float]:
    """One request over a raw socket, the answer read while the body is still going out
    (a server that answers early and closes must not be missed): (status, headers, body,
    seconds). An `endless` body is chunked and never ends (up to 256 MiB)."""
    head = [f"{method} {target} HTTP/1.1", f"Host: {LOOPBACK}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    if endless:
        head.append("Transfer-Encoding: chunked")
        piece = b"{" * 65536
        out: Iterator[bytes] = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(4096))
    else:
        out = iter([body] if body else [])
    started = time.monotonic()
    answer = b""
    with socket.create_connection((LOOPBACK, port), timeout=deadline_s) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        pending = b""
        while time.monotonic() - started < deadline_s:
            ready, writable, _ = select.select([s], [s] if pending or out else [], [], 0.2)
            if ready:
                try:
                    got = s.recv(1 << 20)
                except ConnectionResetError:
                    break
                if not got:
                    break
                answer += got
                if _complete(answer, method):
                    break
                continue
            if writable:
                if not pending:
                    pending = next(out, b"")
                    if not pending:
                        out = iter(())
                        continue
                try:
                    pending = pending[s.send(pending):]
                except (BrokenPipeError, ConnectionResetError):
                    out, pending = iter(()), b""
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 "), (method, target, answer[:300])
    raw_headers, _, content = rest.partition(b"\r\n\r\n")
    parsed = {k.strip().lower(): v.strip() for k, _, v in
              (line.decode("latin-1").partition(":") for line in raw_headers.split(b"\r\n"))}
    return int(status_line.split()[1]), parsed, content, time.monotonic() - started


def _complete(answer: bytes, method: str) -> bool:
    head, sep, content = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    if method == "HEAD":
        return True
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(content) >= int(value)
    return False  # no length: read until the server closes


def _send(w: World, route: tuple[str, str], *, token: str | None,
          target: str | None = None, body: bytes | None = None, endless: bool = False,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes, float]:
    case = CASES[route]
    sent = dict(headers or {})
    if token is not None:
        sent["authorization"] = f"Bearer {token}"
    if body is None and not endless and case.body:
        body = _valid_body(w, case)
    if body is not None:
        sent.setdefault("content-type", "application/json")
        sent.setdefault("content-length", str(len(body)))
    return _exchange(w.server.port, _method(route), target or w.fill(case.target), sent,
                     body, endless=endless)


def _valid_body(w: World, case: Case) -> bytes:
    """A body the route would take (aimed at the victim's ids where it names any)."""
    if case.body == "blob":
        return b"not the victim's bytes"
    if case.body == "manifest":
        return w.manifest
    if case.body == "event":
        return json.dumps({**EVENT, "model": w.secret_model}).encode()
    return json.dumps({**BODIES[case.body], "job": w.job} if case.body == "resolve"
                      else {**BODIES[case.body], "holder": w.holder} if case.body == "claim"
                      else BODIES[case.body]).encode()


def _clear_4xx(status: int, headers: dict[str, str], content: bytes, method: str,
               *expected: int) -> None:
    assert status in expected, (status, content[:300])
    if 400 <= status < 500 and method != "HEAD":
        assert headers.get("content-type") == "application/json", (status, headers)
        assert json.loads(content)["error"]["message"]


# -- the attacks -----------------------------------------------------------------------
@pytest.mark.parametrize("route", GUARDED, ids=lambda r: f"{r[0]} {r[1]}")
def test_no_token_is_401(world: World, route: tuple[str, str]) -> None:
    status, headers, content, _ = _send(world, route, token=None)
    _clear_4xx(status, headers, content, _method(route), 401)


@pytest.mark.parametrize("route", GUARDED, ids=lambda r: f"{r[0]} {r[1]}")
def test_a_token_without_the_scope_is_403(world: World, route: tuple[str, str]) -> None:
    status, headers, content, _ = _send(world, route,
                                        token=world.token_without(CASES[route].scope))
    _clear_4xx(status, headers, content, _method(route), 403)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_a_percent_encoded_token_is_no_token(world: World, route: tuple[str, str]) -> None:
    """`%5F` for `_`, or the whole token %-encoded, in the header (not a token: 401), in
    the query and in the path (where no token is read); none of them reaches the log."""
    token = world.token_for(CASES[route].scope)
    spelled = ["".join(f"%{b:02X}" for b in token.encode()), token.replace("_", "%5F")]
    public = CASES[route].scope == "public"
    for written in spelled:
        status, headers, content, _ = _send(world, route, token=written)
        _clear_4xx(status, headers, content, _method(route), 200 if public else 401)
        target = world.fill(CASES[route].target)
        target += ("&" if "?" in target else "?") + f"token={written}&tok%65n={written}"
        status, headers, content, _ = _send(world, route, token=None, target=target)
        _clear_4xx(status, headers, content, _method(route), 200 if public else 401)
    status, _, _, _ = _send(world, route, token=None, target=f"/v1/ac/{spelled[0]}")
    assert status in (400, 401, 404, 405), status


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_another_tenants_ids_show_and_change_nothing_of_it(world: World,
                                                           route: tuple[str, str]) -> None:
    case = CASES[route]
    status, headers, content, _ = _send(world, route, token=world.token_for(case.scope))
    _clear_4xx(status, headers, content, _method(route), case.other)
    asked = world.fill(case.target).encode() + (_valid_body(world, case) if case.body else b"")
    for secret in (world.victim, world.secret_model, world.holder):
        if secret.encode() not in asked:  # an answer may name what the caller sent
            assert secret.encode() not in content, (route, secret, content[:300])


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_an_oversized_body_is_413_before_it_is_read(world: World,
                                                    route: tuple[str, str]) -> None:
    """A body one byte over the route's limit (1 MiB of junk where the route takes none:
    answered as usual, unread)."""
    case = CASES[route]
    body = b"x" * (case.limit + 1 if case.body else MAX_BLOB)
    status, headers, content, took = _send(world, route, token=world.token_for(case.scope),
                                           body=body)
    assert took < 10, took
    if case.body:
        _clear_4xx(status, headers, content, _method(route), 413)
    else:
        assert status < 500 and status == _send(
            world, route, token=world.token_for(case.scope))[0], (status, content[:200])


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_a_body_that_never_ends_is_cut_off(world: World, route: tuple[str, str]) -> None:
    """Chunked and endless: 411 where a length is required, 413 where the route reads a
    small body; a route that takes no body answers without reading it. Within seconds."""
    case = CASES[route]
    status, headers, content, took = _send(world, route, token=world.token_for(case.scope),
                                           endless=True)
    assert took < 10, took
    if case.body:
        _clear_4xx(status, headers, content, _method(route), 411, 413)
    else:
        assert status < 500, (status, content[:200])


def _with_raw(document: Any, path: str, raw: str) -> str:
    """`document` as JSON text with the value at `path` (dotted; list indexes as digits)
    replaced by `raw` JSON text (NaN, 1e999, five thousand digits; a string with a lone
    surrogate or a control character escaped)."""
    marker = "__RAW__"
    node = document
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = marker
    else:
        node[last] = marker
    return json.dumps(document).replace(f'"{marker}"', raw)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_nan_and_huge_numbers_are_422(world: World, route: tuple[str, str]) -> None:
    """In every JSON field and query parameter the route takes as a number (413 where five
    thousand digits pass a small body's limit); a route that takes none answers as usual
    with such parameters added."""
    case = CASES[route]
    token = world.token_for(case.scope)
    wheres = list(case.numbers)
    if case.body in SCHEMAS:
        wheres += schema_fields(SCHEMAS[case.body], json.loads(_own_body(world, case)))[0]
    if not wheres:
        target = world.fill(case.target)
        target += ("&" if "?" in target else "?") + "limit=NaN&hours=1e999&ttl_s=" + "9" * 5000
        status, _, content, _ = _send(world, route, token=token, target=target)
        assert status < 500 and status == _send(world, route, token=token)[0], content[:200]
        return
    for where in wheres:
        for raw in NUMBERS:
            if where.startswith("?"):
                target = world.fill(case.target.replace("?namespace={namespace}", ""))
                target += ("&" if "?" in target else "?") + f"{where[1:]}={raw}"
                status, headers, content, _ = _send(world, route, token=token, target=target)
            else:
                own = json.loads(_own_body(world, case))
                body = _with_raw(own, where, raw).encode()
                status, headers, content, _ = _send(world, route, token=token, body=body,
                                                    target=_own_target(world, case))
            # the body's own key: refused by the rule for the number, never a mismatch
            _clear_4xx(status, headers, content, _method(route), 413, 422)


@pytest.mark.parametrize(("route", "field"), [
    ("progress", "model"), ("event", "model"), ("event", "reason"),
    ("event", "precompile_reason"), ("event", "differing")])
@pytest.mark.parametrize("name", ["m\\ud800x", "m\\nx", "m\\u001b[2Jx", "m\\u0000x"])
def test_text_that_is_not_text_is_422_and_the_views_stay_200(
        world: World, route: str, field: str, name: str) -> None:
    """#47: a lone surrogate (JSON escape) in a model name was 202, then 500 on every view
    of the namespace (the event: 500 on the post); a CR or ESC in a reason reached the views
    and logs raw. The wire schema's text rule refuses each free-text field."""
    token = {"authorization": f"Bearer {world.token_for('write')}",
             "content-type": "application/json"}
    if route == "progress":
        target = "/v1/jobs/text-attack/progress"
        body = (f'{{"attempt":0,"records":[{{"kind":"start","at":{time.time()!r}}}],'
                f'"model":"{name}"}}')
    else:
        target = "/v1/events"
        value = ["__M__"] if field == "differing" else "__M__"
        body = json.dumps({**EVENT, field: value}).replace("__M__", name)
    with httpx.Client(base_url=world.server.url, timeout=30) as c:
        answer = c.post(target, content=body.encode(), headers=token)
        assert answer.status_code == 422, answer.text[:300]
        assert field in answer.text
        read = {"authorization": f"Bearer {world.token_for('read')}"}
        for view in ("/v1/jobs", "/v1/stats", "/v1/dashboard"):
            assert c.get(view, headers=read).status_code == 200, view


@pytest.mark.parametrize("where", ["fingerprint.model", "fingerprint.code", "torch_version",
                                   "triton_version", "producer.rank", "blobs.0.meta.files",
                                   "fingerprint.config.a\\u001bkey"])
def test_a_manifest_whose_names_are_not_text_is_422_though_its_key_matches(
        hostile: ServerProcess, where: str) -> None:
    """#47: a manifest's names (its fingerprint's model and code, versions, producer and
    meta values, component keys) follow the text rule too. The key is recomputed from the
    bad fingerprint, so nothing but the rule refuses it (before: 201, stored, shown raw);
    the same manifest with clean text is 201."""
    n = os.urandom(3).hex()
    ns = f"text-{n}"
    auth = {"authorization": f"Bearer {hostile.token('read,write', namespace=ns, name=f't-{n}')}"}
    data = os.urandom(3000)
    m = make_manifest({"megacache": data}, make_fingerprint(model=f"m-{n}", namespace=ns))
    doc = json.loads(m.to_json())
    doc["producer"] = {"client": "megacache test", "rank": "0"}
    doc["triton_version"] = "3.0.0"
    doc["blobs"][0].setdefault("meta", {})["files"] = "1"

    def put(c: httpx.Client, value: str) -> httpx.Response:
        d = json.loads(json.dumps(doc))
        *parents, last = where.split(".")
        node = d
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if last.startswith("a\\"):  # a bad key: the value is clean
            node[json.loads(f'"{last}"') if value != "ok" else "a-key"] = "v"
        else:
            node[last] = json.loads(f'"{value}"')
        fp = {"format": MANIFEST_FORMAT, **d["fingerprint"]}  # canonical_json, surrogates kept
        d["key"] = sha256_hex(json.dumps(fp, sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=False).encode("utf-8", "surrogatepass"))
        body = json.dumps(d).encode()
        return c.put(f"/v1/ac/{d['key']}", content=body,
                     headers={"content-type": "application/json"})

    with httpx.Client(base_url=hostile.url, headers=auth, timeout=30) as c:
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        for bad in ("m\\ud800x", "m\\nx", "m\\u001b[2Jx", "m\\u0000x"):
            answer = put(c, bad)
            assert answer.status_code == 422, (bad, answer.status_code, answer.text[:300])
        assert c.get("/v1/ac", params={"namespace": ns}).json() == {"entries": []}
        assert put(c, "ok").status_code == 201
        for view in ("/v1/stats", "/v1/dashboard", "/v1/jobs"):
            assert c.get(view).status_code == 200, view


@pytest.mark.parametrize("route", [r for r in BODY_ROUTES if CASES[r].body in SCHEMAS],
                         ids=lambda r: f"{r[0]} {r[1]}")
def test_surrogates_and_controls_in_every_text_field_are_refused(
        world: World, route: tuple[str, str]) -> None:
    """#47: every text field of every JSON body, by its schema (names, reasons, details,
    ids, enums, times, dict keys' values), with a lone surrogate, ESC, LF, CR or NUL: a
    clear 4xx (422 by the text rule or the field's own pattern; 400 where a manifest's key
    no longer matches), never stored, never a 5xx."""
    case = CASES[route]
    token = world.token_for(case.scope)
    own = _own_body(world, case)
    texts = schema_fields(SCHEMAS[case.body], json.loads(own))[1]
    assert texts, route
    for where in texts:
        for raw in TEXTS:
            body = _with_raw(json.loads(own), where, raw).encode()
            status, headers, content, _ = _send(world, route, token=token, body=body,
                                                target=_own_target(world, case))
            # the text rule refuses it before the key is compared: 422, never a mismatch
            assert status == 422, (where, raw, status, content[:300])
            _clear_4xx(status, headers, content, _method(route), 422)


def object_paths(cls: type, doc: dict[str, Any], prefix: str = "",
                 dicts: list[str] | None = None) -> list[str]:
    """The dotted paths of every JSON object in `doc` (a valid body of `cls`): `doc`
    itself (""), its nested schemas and its dict fields (also added to `dicts`), by
    `cls`'s own fields; a dict field `doc` lacks is added to it, empty, so that it is
    attacked too."""
    found = [prefix.rstrip(".")]
    for name, hint in _hints(cls).items():
        for arm in _arms(hint):
            kind, value = _kind(arm), doc.get(name)
            if kind == "dict" and value is None:
                value = doc[name] = {}
            if kind == "dict" and isinstance(value, dict):
                found.append(prefix + name)
                if dicts is not None:
                    dicts.append(prefix + name)
            elif kind == "schema" and isinstance(value, dict):
                found += object_paths(arm, value, f"{prefix}{name}.", dicts)
            elif kind == "list" and isinstance(value, list):
                (item,) = typing.get_args(arm)
                for i, v in enumerate(value):
                    for inner in _arms(item):
                        if _kind(inner) == "schema" and isinstance(v, dict):
                            found += object_paths(inner, v, f"{prefix}{name}.{i}.", dicts)
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("route", [r for r in BODY_ROUTES if CASES[r].body in SCHEMAS],
                         ids=lambda r: f"{r[0]} {r[1]}")
def test_a_key_that_is_not_text_anywhere_in_a_body_is_a_clean_422(
        world: World, route: tuple[str, str]) -> None:
    """#58: a lone surrogate as a JSON key (of meta, artifact counts, env, hw, config,
    producer, or a field name no schema has) gave a 500 with a traceback: the 422 echoed
    the key and could not be encoded. Every object of every JSON body, by its schema, gets
    such a key: a 422 (or 400) whose body is JSON naming the key escaped."""
    case = CASES[route]
    own = json.loads(_own_body(world, case))
    paths = object_paths(SCHEMAS[case.body], own)
    assert "" in paths, paths
    for where in paths:
        doc = json.loads(json.dumps(own))
        node = doc
        for part in where.split(".") if where else ():
            node = node[int(part)] if isinstance(node, list) else node[part]
        node["__BADKEY__"] = "x"
        body = json.dumps(doc).replace('"__BADKEY__"', '"k\\ud800\\u202e"').encode()
        status, headers, content, _ = _send(world, route, token=world.token_for(case.scope),
                                            body=body)
        _clear_4xx(status, headers, content, _method(route), 400, 422)
        text = content.decode()  # pydantic's bodies: refused as JSON, by position
        assert status == 400 or "\\\\ud800\\\\u202e" in text or "column" in text, \
            (where, content[:300])


def test_a_manifest_dict_over_its_entries_or_a_value_over_its_length_is_422(
        world: World) -> None:
    """#58: sizes are bounded where they enter. Every dict of the manifest, by its schema
    (blob meta, env, hw, config, artifact counts, producer), with 65 entries, and every
    string value with 4,097 characters (over every cap), is a clear 422."""
    route = ("PUT", "/v1/ac/{key}")
    own = json.loads(_own_body(world, CASES[route]))
    dicts: list[str] = []
    object_paths(Manifest, own, dicts=dicts)
    assert {"fingerprint.config", "fingerprint.env", "blobs.0.meta", "producer",
            "artifact_counts"} <= set(dicts), dicts
    for where in dicts:
        for entries, value in ((65, 1 if where == "artifact_counts" else "v"),
                               (1, "x" * 4097)):
            doc = json.loads(json.dumps(own))
            node = doc
            for part in where.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
            node.clear()
            node.update({f"k{i}": value for i in range(entries)})
            status, headers, content, _ = _send(world, route, body=json.dumps(doc).encode(),
                                                token=world.token_for("write"))
            _clear_4xx(status, headers, content, "PUT", 422)
            if where == "artifact_counts" and entries == 1:
                continue  # a count, not text: refused by its type
            assert "should have at most" in content.decode(), (where, content[:300])


def _own_body(w: World, case: Case) -> bytes:
    """A body of the attacker's own namespace, valid but for the number under attack."""
    if case.body == "manifest":  # with its own key: a key mismatch refuses nothing here
        m = json.loads(w.manifest)
        m["fingerprint"]["namespace"] = w.attacker
        m["key"] = parse(Fingerprint, m["fingerprint"]).key()
        return json.dumps(m).encode()
    return _valid_body(w, case)


def _own_target(w: World, case: Case) -> str | None:
    """Where the attacker's own body goes: a manifest to its own key (None: the case's)."""
    if case.body != "manifest":
        return None
    return w.fill(case.target.replace("{key}", json.loads(_own_body(w, case))["key"]))


# -- what is left after the attacks ----------------------------------------------------
def test_after_every_attack_the_victim_is_whole_and_nothing_was_stored(
        world: World) -> None:
    """Runs last in this file (pytest keeps file order): the victim's entry, blob, job
    resolution, claim and stats are as they were; the attacker's namespace holds no entry,
    no blob, no quarantine; no traceback and no token in the server's log."""
    server = world.server
    victim = {"authorization": f"Bearer {world.victim_token}"}
    with httpx.Client(base_url=server.url, headers=victim, timeout=30) as c:
        assert c.get(f"/v1/ac/{world.key}").content == world.manifest
        assert sha256(c.get(f"/v1/cas/{world.digest}").content) == world.digest
        again = c.post(f"/v1/ac/{world.key}/resolve", json={"job": world.job})
        assert again.status_code == 200 and again.content == world.manifest
        held = c.post(f"/v1/ac/{world.key}/claim", json={"holder": "someone-else"})
        assert held.status_code == 409 and held.json()["error"]["holder"] == world.holder
        assert c.get("/v1/stats").json()["total"]["runs"] == 1
        for job in ("victim-job", "victim-job-2"):
            ett = c.get(f"/v1/jobs/{job}/ett").json()
            assert ett["seconds"]["training"] == 90.0 and ett["wall_s"] == 100.0, ett
            assert len(ett["attempts"]) == 1 and ett["model"] == world.secret_model
        assert c.get("/v1/quarantine").json()["quarantined"] == []
        deadline = time.monotonic() + 30  # the victim's jobs rolled into its trend
        while not c.get("/v1/ett/trend").json()["models"]:
            assert time.monotonic() < deadline, "the victim's jobs never reached its trend"
            time.sleep(0.25)
        assert [m["model"] for m in c.get("/v1/ett/trend").json()["models"]] == [
            world.secret_model]
    attacker = {"authorization": f"Bearer {world.tokens['read']}"}
    with httpx.Client(base_url=server.url, headers=attacker, timeout=30) as c:
        assert c.get("/v1/ac", params={"limit": 1000}).json() == {"entries": []}
        assert c.get("/v1/quarantine").json()["quarantined"] == []
        assert c.get("/v1/jobs/victim-job/ett").status_code == 404
        trend = c.get("/v1/ett/trend", params={"days": 400}).json()
        assert world.secret_model not in json.dumps(trend), trend  # no victim's row, no job
        assert c.head(f"/v1/cas/{sha256(b'not the victim' + b's bytes')}").status_code == 404
        # the last request, named: once its line is in the log (one worker, written in
        # order), so is every attack's before it
        last = f"last-request-{uuid.uuid4().hex}"
        assert c.get("/healthz", params={"probe": last}).status_code == 200
    deadline = time.monotonic() + 10
    while last not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log()
    assert last in log, f"the last request never reached the log: {log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
    for token in (*world.tokens.values(), world.victim_token):
        assert token.split("_", 2)[2] not in log


def test_the_threat_model_names_only_tests_that_exist() -> None:
    """docs/security.md's tables name the test proving each protection: each must exist
    (`file.py::test_name`, or `…::test_name` for the file named before it)."""
    import ast
    import re

    tests = Path(__file__).resolve().parent
    doc = (tests.parent / "docs" / "security.md").read_text()
    named: list[tuple[str, str]] = []
    current = ""
    for file, name in re.findall(r"`(?:(test_\w+\.py)|…)::(test_\w+)`", doc):
        current = file or current
        named.append((current, name))
    assert len(named) >= 20, named
    missing = []
    for file, name in named:
        tree = ast.parse((tests / file).read_text())
        if name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            missing.append(f"{file}::{name}")
    assert not missing, missing
