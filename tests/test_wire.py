"""The wire contract (megacache_client/wire/): one route table and one set of header names
that the server serves, the client calls and the docs describe, checked both ways."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from helpers import make_fingerprint, make_manifest, sha256

from megacache_client.config import ClientConfig
from megacache_client.transport.client import RemoteCache
from megacache_client.wire import headers, routes
from megacache_server.api.app import create_app
from megacache_server.api.route_table import served
from megacache_server.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "http-api.md"
DOC_ROUTE = re.compile(r"`(GET|HEAD|PUT|POST|DELETE) (/[^`?\s]*)")


def _shape(path: str) -> str:
    """A path with its parameters unnamed: the docs say `{sha256}` where the code says
    `{digest}`."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def _table() -> set[tuple[str, str]]:
    return {(r.method, _shape(r.path)) for r in routes.ROUTES}


def _served(tmp_path: Path) -> tuple[set[tuple[str, str]], set[str]]:
    app = create_app(Settings(data_dir=tmp_path))
    found = list(served(app.router.routes))
    return ({(m, _shape(p)) for m, p, _ in found if m != "MOUNT"},
            {p for m, p, _ in found if m == "MOUNT"})


def test_every_route_the_app_serves_is_in_the_table_and_the_reverse(tmp_path: Path) -> None:
    endpoints, mounts = _served(tmp_path)
    assert endpoints - _table() == set(), "served but not in megacache_client/wire/routes.py"
    assert _table() - endpoints == set(), "in the route table but not served"
    assert mounts == {"/docs/assets"}  # Swagger UI's bundled files, served offline


def test_every_route_is_in_the_http_api_docs_and_the_reverse() -> None:
    documented = {(m, _shape(p)) for m, p in DOC_ROUTE.findall(DOCS.read_text())}
    assert _table() - documented == set(), "not described in docs/http-api.md"
    assert documented - _table() == set(), "docs/http-api.md names a route nobody serves"


def test_route_urls_encode_each_parameter_whole() -> None:
    assert routes.GET_ENTRY.url(key="a" * 64) == "/v1/ac/" + "a" * 64
    # a hostile value stays inside its own segment
    assert routes.GET_BLOB.url(digest="../../x?y") == "/v1/cas/..%2F..%2Fx%3Fy"


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_the_client_builds_no_url_by_hand() -> None:
    """Every path the client calls comes from the route table."""
    found = [f"{p.relative_to(ROOT)}:{line}: {value[:40]!r}"
             for p in sorted((ROOT / "megacache_client").rglob("*.py"))
             if p.parent.name != "wire"
             for line, value in _string_constants(p)
             if re.match(r"/(v1|metrics|healthz|readyz)\b", value)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", ["megacache_client", "megacache_server"])
def test_header_names_are_written_only_in_the_wire_contract(package: str) -> None:
    found = [f"{p.relative_to(ROOT)}:{line}"
             for p in sorted((ROOT / package).rglob("*.py")) if p.parent.name != "wire"
             for line, value in _string_constants(p)
             if value.lower().startswith("x-megacache-")]
    assert not found, "\n".join(found)


def test_the_headers_the_server_reads_are_sent_by_the_client(server, monkeypatch) -> None:
    """PUT /v1/ac/{key} records the producer's version, job and attempt in the entry's
    provenance: the client's own put sends them (in a job), so the record is filled."""
    monkeypatch.setenv("MEGACACHE_JOB_ID", "wire-job-7")
    monkeypatch.setenv("MEGACACHE_ATTEMPT", "3")
    data = b"wire contract"
    manifest = make_manifest({"megacache": data}, make_fingerprint(model="wire"))
    config = ClientConfig(url=server.url)
    with RemoteCache(config) as remote:
        assert remote._http.put(routes.PUT_BLOB.url(digest=sha256(data)),
                                content=data).status_code in (200, 201)
        assert remote.put_entry(manifest) is not None
        got = remote._http.get(routes.GET_ENTRY.url(key=manifest.key))
    record = json.loads(got.headers[headers.PROVENANCE])
    from megacache_client.wire.version import __version__
    assert (record["client_version"], record["job"], record["attempt"]) == \
        (__version__, "wire-job-7", 3)
    assert set(headers.SENT_BY_CLIENT) == {headers.CLIENT_VERSION, headers.JOB,
                                           headers.ATTEMPT}
