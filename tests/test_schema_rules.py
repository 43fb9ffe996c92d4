"""The shared schema has two validators: the standard library one the client runs on its
start path (`megacache_client.wire.schema`) and pydantic's reading of the same declaration (the
OpenAPI document). They must agree on what is valid, and the start path must not import
pydantic at all (the reason the first one exists)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from helpers import make_fingerprint
from pydantic import TypeAdapter, ValidationError

from megacache_client.wire.events import Event
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest
from megacache_client.wire.schema import SchemaError, parse, parse_json

Doc = dict[str, Any]


def manifest_doc() -> Doc:
    fp = make_fingerprint(env={"torch": "2.13.0", "debug": False, "tf32": 1.5, "cuda": None})
    m = Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0", cold_compile_s=12.5,
                 blobs=[BlobRef(digest="a" * 64, size=10, role="megacache", raw_size=40,
                                raw_sha256="b" * 64, meta={"torch": "2.13.0"}),
                        BlobRef(digest="c" * 64, size=3, role="kernels", compression="none")],
                 artifact_counts={"inductor": 3}, producer={"host_class": "cpu"})
    return json.loads(m.to_json())


def event_doc() -> Doc:
    return {"key": "d" * 64, "model": "mlp", "outcome": "hit", "compile_s": 1.0,
            "cold_compile_s": 10.0, "saved_s": 9.0, "bytes_down": 1024, "differing": ["code"],
            "tts_s": 3.5, "created_at": "2026-12-01T12:00:00Z"}


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path
        for p in parents:
            doc = doc[p]
        doc[last] = value
    return mutate


def _drop(path: tuple[Any, ...]) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path
        for p in parents:
            doc = doc[p]
        del doc[last]
    return mutate


MANIFEST_CASES: dict[str, Callable[[Doc], None]] = {
    "valid": lambda d: None,
    "extra field": _set(("surprise",), 1),
    "extra blob field": _set(("blobs", 0, "surprise"), 1),
    "missing key": _drop(("key",)),
    "missing blob size": _drop(("blobs", 0, "size")),
    "key not hex": _set(("key",), "X" * 64),
    "key with a newline": _set(("key",), "a" * 64 + "\n"),
    "key of another fingerprint": _set(("key",), "e" * 64),
    "size as text": _set(("blobs", 0, "size"), "10"),
    "size as bool": _set(("blobs", 0, "size"), True),
    "size as float": _set(("blobs", 0, "size"), 10.0),
    "size negative": _set(("blobs", 0, "size"), -1),
    "size over 2**53": _set(("blobs", 0, "size"), 2**53 + 1),
    "size huge": _set(("blobs", 0, "size"), 10**300),
    "role with capitals": _set(("blobs", 0, "role"), "Kernels"),
    "compression unknown": _set(("blobs", 0, "compression"), "gzip"),
    "meta value too long": _set(("blobs", 0, "meta", "torch"), "x" * 4097),
    "meta empty key": _set(("blobs", 0, "meta", ""), "v"),
    "meta value a number": _set(("blobs", 0, "meta", "n"), 1),
    "no blobs": _set(("blobs",), []),
    "17 blobs": lambda d: d.__setitem__("blobs", [
        {"digest": f"{i:064x}", "size": 1, "role": "megacache"} for i in range(17)]),
    "blob listed twice": lambda d: d["blobs"].append(copy.deepcopy(d["blobs"][0])),
    "blobs not a list": _set(("blobs",), {"0": 1}),
    "blob not an object": _set(("blobs", 0), "a" * 64),
    "format 2": _set(("format",), 2),
    "format true": _set(("format",), True),
    "cold compile NaN": _set(("cold_compile_s",), math.nan),
    "cold compile infinite": _set(("cold_compile_s",), math.inf),
    "cold compile over a week": _set(("cold_compile_s",), 8 * 86400.0),
    "cold compile an int": _set(("cold_compile_s",), 12),
    "cold compile as text": _set(("cold_compile_s",), "12"),
    "count negative": _set(("artifact_counts", "inductor"), -1),
    "torch version empty": _set(("torch_version",), ""),
    "triton version null": _set(("triton_version",), None),
    "triton version too long": _set(("triton_version",), "x" * 257),
    "created without timezone": _set(("created_at",), "2026-12-01T12:00:00"),
    "created not a date": _set(("created_at",), "yesterday"),
    "created as a number": _set(("created_at",), 1764590400),
    "producer value too long": _set(("producer", "host_class"), "x" * 257),
    # #58: every dict bounded in entries where it enters
    "33 meta entries": _set(("blobs", 0, "meta"), {f"k{i}": "v" for i in range(33)}),
    "33 artifact counts": _set(("artifact_counts",), {f"k{i}": 1 for i in range(33)}),
    "33 producer entries": _set(("producer",), {f"k{i}": "v" for i in range(33)}),
}
"""Documents the two validators must judge alike. A fingerprint change alters the key, so
fingerprint cases are below, on the Fingerprint alone."""

FINGERPRINT_CASES: dict[str, tuple[str, Any]] = {
    "valid float": ("env", {"tf32": 0.5}),
    "NaN value": ("env", {"tf32": math.nan}),
    "infinite value": ("hw", {"x": -math.inf}),
    "nested value": ("config", {"x": [1]}),
    "object value": ("config", {"x": {"y": 1}}),
    "long key": ("env", {"k" * 257: 1}),
    "empty key": ("env", {"": 1}),
    "namespace with capitals": ("namespace", "Team-A"),
    "namespace too long": ("namespace", "a" * 65),
    "model empty": ("model", ""),
    "model too long": ("model", "m" * 257),
    "code a number": ("code", 7),
    # #58: a 63 KB config string made a listing of 1,000 entries 60 MiB
    "valid longest value": ("config", {"x": "v" * 256}),
    "value too long": ("config", {"x": "v" * 257}),
    "valid 64 entries": ("env", {f"k{i}": i for i in range(64)}),
    "65 entries": ("hw", {f"k{i}": i for i in range(65)}),
}


STRICTER_THAN_PYDANTIC = {"format true"}
"""pydantic matches `Literal[1]` by equality even in strict mode, and `True == 1`; the JSON
schema says `const: 1`, and the server (which runs ours) refuses `true`."""


def _pydantic_accepts(cls: type, doc: Doc) -> bool:
    try:
        TypeAdapter(cls).validate_json(json.dumps(doc))
        return True
    except ValidationError:
        return False


def _ours_accepts(cls: type, doc: Doc) -> bool:
    try:
        parse_json(cls, json.dumps(doc))
        return True
    except SchemaError as exc:
        assert exc.errors and {"loc", "msg", "type"} <= exc.errors[0].keys()
        return False


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_manifest_validators_agree(case: str) -> None:
    doc = manifest_doc()
    MANIFEST_CASES[case](doc)
    ours = _ours_accepts(Manifest, doc)
    if case not in STRICTER_THAN_PYDANTIC:
        assert ours == _pydantic_accepts(Manifest, doc)
    assert ours == (case in ("valid", "cold compile an int", "triton version null"))


@pytest.mark.parametrize("case", list(FINGERPRINT_CASES))
def test_fingerprint_validators_agree(case: str) -> None:
    field, value = FINGERPRINT_CASES[case]
    doc = make_fingerprint().to_dict()
    doc[field] = value
    ours = _ours_accepts(Fingerprint, doc)
    assert ours == _pydantic_accepts(Fingerprint, doc)
    assert ours == case.startswith("valid")


@pytest.mark.parametrize("mutate,valid", [
    (lambda d: None, True),
    (lambda d: d.update(saved_s=11.0), False),  # saved more than the cold compile it saved
    (lambda d: d.update(outcome="great"), False),
    (lambda d: d.update(bytes_down=2**41), False),
    (lambda d: d.update(tts_s=-1.0), False),
    (lambda d: d.update(differing=["x"] * 9), False),
    (lambda d: d.update(differing=["x" * 33]), False),
    (lambda d: d.update(entry_key=None, published=True), True),
    (lambda d: d.update(published=1), False),
])
def test_event_validators_agree(mutate: Callable[[Doc], None], valid: bool) -> None:
    doc = event_doc()
    mutate(doc)
    assert _ours_accepts(Event, doc) is valid
    assert _pydantic_accepts(Event, doc) is valid


def test_a_parsed_manifest_equals_what_pydantic_builds_and_round_trips() -> None:
    doc = manifest_doc()
    ours = parse(Manifest, doc)
    assert ours == TypeAdapter(Manifest).validate_json(json.dumps(doc))
    assert isinstance(ours.blobs[0], BlobRef) and ours.created_at.tzinfo is not None
    assert Manifest.from_json(ours.to_json()) == ours
    assert ours.cold_compile_s == 12.5 and ours.blobs[1].compression == "none"


def test_construction_validates_as_parsing_does() -> None:
    fp = make_fingerprint()
    with pytest.raises(SchemaError, match="blobs"):
        Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0", cold_compile_s=1.0,
                 blobs=[])
    with pytest.raises(ValueError, match="does not match its fingerprint"):
        Manifest(key="0" * 64, fingerprint=fp, torch_version="2.13.0", cold_compile_s=1.0,
                 blobs=[BlobRef(digest="a" * 64, size=1, role="megacache")])
    with pytest.raises(SchemaError, match="env.x"):
        Fingerprint(model="m", code="c", env={"x": math.nan})


def test_bad_json_is_a_schema_error_not_a_crash() -> None:
    for body in (b"{", b"\xff\xfe", b"[" * 100_000, b'{"size": ' + b"9" * 5000 + b"}"):
        with pytest.raises(SchemaError) as err:
            parse_json(Manifest, body)
        assert err.value.errors[0]["type"] == "json_invalid"


def test_openapi_documents_the_rules() -> None:
    schema = TypeAdapter(Manifest).json_schema()
    blob = schema["$defs"]["BlobRef"]
    assert blob["properties"]["digest"]["pattern"] == "^[0-9a-f]{64}$"
    assert blob["properties"]["size"]["maximum"] == 2**53
    assert "CAS address" in blob["properties"]["digest"]["description"]
    assert schema["properties"]["blobs"]["maxItems"] == 16
    assert schema["additionalProperties"] is False


def test_the_client_start_path_imports_neither_pydantic_nor_httpx_cli() -> None:
    """What a trainer pays after `import torch`: the client, ready to load (the schema, the
    transport), without pydantic (~150 ms) or httpx's command-line client (click, rich)."""
    code = ("import sys, megacache_client, megacache_client.wire.manifest, "
            "megacache_client.wire.events; "
            "import megacache_client.transport.client, megacache_client.steps.prefetch; "
            "print(sorted(m for m in ('pydantic', 'httpx._main', 'rich', 'fastapi') "
            "if m in sys.modules)); import httpx._main")  # and the CLI still imports later
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]"]


def test_subclasses_of_json_types_are_taken_as_plain_values() -> None:
    """What a trainer's code hands the client: torch.__version__ is a str subclass, numpy's
    float64 a float subclass; bool is an int subclass and stays refused as a number."""
    import enum

    class Version(str):
        pass

    class Level(enum.IntEnum):
        HIGH = 3

    fp = Fingerprint(model=Version("m"), code="c", env={"torch": Version("2.13.0"),
                                                         "level": Level.HIGH})
    assert type(fp.model) is str and type(fp.env["torch"]) is str
    assert fp.env["level"] == 3 and type(fp.env["level"]) is int
    assert fp.key() == make_fingerprint(model="m", code="c", hw={}, config={},
                                        env={"torch": "2.13.0", "level": 3}).key()
    blob = BlobRef(digest="a" * 64, size=Level.HIGH, role="megacache",
                   meta={"torch": Version("2.13.0")})
    assert type(blob.size) is int and type(blob.meta["torch"]) is str
    with pytest.raises(SchemaError, match="size"):
        BlobRef(digest="a" * 64, size=True, role="megacache")
