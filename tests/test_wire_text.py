"""Names are text (#47 item 1): the wire schema refuses a model name with a lone surrogate
or a control character where it parses (both sides), and escape_foreign renders any text
printable in one line."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megacache_client.wire.progress import ProgressBatch
from megacache_client.wire.schema import SchemaError, parse_json
from megacache_client.wire.text import TEXT_CAP, escape_foreign, is_text


def _batch(model_json: str) -> bytes:
    at = int(time.time())
    return f'{{"attempt":0,"records":[{{"kind":"start","at":{at}}}],"model":{model_json}}}'.encode()


@pytest.mark.parametrize("model", ['"m\\ud800x"', '"m\\nx"', '"m\\u001bx"', '"m\\u0000"',
                                   '"m\\rx"', '"m\\u0085x"', '"m\\u007fx"'])
def test_a_progress_batch_whose_model_is_not_text_is_refused(model: str) -> None:
    with pytest.raises(SchemaError) as err:
        parse_json(ProgressBatch, _batch(model))
    assert err.value.errors[0]["loc"] == ["model"]
    assert "printable" in str(err.value)


def test_a_clean_model_name_parses() -> None:
    assert parse_json(ProgressBatch, _batch('"llama-7b é/ß"')).model == "llama-7b é/ß"


def test_escape_foreign_leaves_one_printable_line() -> None:
    out = escape_foreign("a\nb\x1b[2J\r\ud800\x00\\", 100)
    assert out == "a\\nb\\x1b[2J\\r\\ud800\\x00\\"
    assert is_text(out) and escape_foreign(out, 100) == out  # twice escaped reads the same
    assert escape_foreign("x" * (TEXT_CAP + 5)).endswith("…")
    assert not is_text("m\ud800x") and not is_text("x" * (TEXT_CAP + 1))


def test_metrics_label_values_carry_no_raw_cr_nul_or_esc() -> None:
    from prometheus_client.core import GaugeMetricFamily

    from megacache_server.service.observability import metrics
    family = GaugeMetricFamily("megacache_t", "t", labels=["model"])
    family.add_metric(["m\r\x00\x1b[2J\ud800x"], 1.0)
    text = metrics._render([family]).decode()
    assert not any(c in text for c in "\r\x00\x1b")
    assert 'model="m\\\\r\\\\x00\\\\x1b[2J\\\\ud800x"' in text
    assert "\r" not in metrics._escape("a\rb") and "\x1b" not in metrics._escape("\x1b")


def test_the_text_log_escapes_a_forged_line() -> None:
    import logging

    from megacache_server.api.logs import TextFormatter
    record = logging.LogRecord("megacache", logging.WARNING, __file__, 1,
                               "report detail: %s", ("x\nWARNING  megacache: forged\r\x1b[2J",),
                               None)
    line = TextFormatter().format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.startswith("WARNING   megacache: report detail: x\\nWARNING")


@pytest.mark.parametrize(("variable", "raw", "clean"), [
    *(("MEGACACHE_MODEL", raw, "llama-7b")
      for raw in ("m\udcffx", "m\nx", "m\x1b[2J", "x" * 300)),
    *(("MEGACACHE_CODE", raw, "v1.2") for raw in ("c\udcffx", "c\nx", "c\x1b[2J"))])
def test_a_name_that_is_not_text_is_dropped_at_enable_with_one_warning(
        variable: str, raw: str, clean: str, caplog: pytest.LogCaptureFixture) -> None:
    """A model or code name follows the text rule (#47): one that breaks it would be refused
    by the server on every progress batch, or make every manifest the client builds fail
    its own schema; it is dropped (the default applies) with one warning."""
    from megacache_client.config import ClientConfig
    field = "model" if variable == "MEGACACHE_MODEL" else "code"
    with caplog.at_level("WARNING", logger="megacache"):
        config = ClientConfig.from_env({variable: raw})
    assert getattr(config, field) is None
    warned = [r for r in caplog.records if variable in r.getMessage()]
    assert len(warned) == 1
    assert getattr(ClientConfig.from_env({variable: clean}), field) == clean


def test_free_text_the_client_did_not_choose_is_sent_as_text() -> None:
    """An exception's message (a reason, a precompile note, a bad-blob detail) may hold a
    newline, ESC or a lone surrogate, and be long: the client escapes and cuts it to the
    field's cap before it builds the event, so the server never refuses a real trainer's
    event for it (each field: `wire.text.as_text`)."""
    from megacache_client.results import LoadResult, Track
    from megacache_client.steps.report import _event
    from megacache_client.wire.manifest import Fingerprint

    raw = "OSError: boom\n\x1b[2J\r\ud800 " + "x" * 3000
    track = Track(Fingerprint(model="m", code="c"), LoadResult())
    track.load.key, track.load.outcome = "0" * 64, "miss"
    track.load.reason, track.load.differing = raw, ["code\n", "x" * 40]
    counters = {"fxgraph_hit": 0, "fxgraph_miss": 0, "aot_hit": 0}
    event = _event(track, counters, None, dict, lambda _: None, {})
    assert event is not None
    assert is_text(event.reason, 2000) and event.reason.startswith("OSError: boom\\n\\x1b")
    assert all(is_text(d, 32) for d in event.differing)
    parse_json(type(event), event.to_json())  # what the server parses, it accepts


def test_a_bad_report_detail_is_refused_where_the_server_parses_it() -> None:
    from pydantic import ValidationError

    from megacache_server.api.routes.trust import BlobReport, EntryReport

    for bad in ("x\ny", "\x1b[2J", "a\ud800"):
        with pytest.raises(ValidationError):
            BlobReport.model_validate({"kind": "digest", "detail": bad})
    with pytest.raises(ValidationError):
        EntryReport.model_validate({"detail": "ok", "job": "job\nforged"})
    assert EntryReport.model_validate({"detail": "ok é", "job": "j-1"}).job == "j-1"


def test_a_listed_entry_stored_before_the_rule_is_skipped_not_the_listing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real server's listing may hold an entry an older server stored before manifests'
    names were text (a producer rank with a newline; the server serves stored bytes as
    they are): the client skips that one with one warning and keeps the rest (before: the
    whole listing raised, losing the fallback)."""
    import asyncio
    import json

    from helpers import ServerProcess, make_fingerprint, make_manifest

    from megacache_client.config import ClientConfig
    from megacache_client.transport.breaker import CircuitBreaker
    from megacache_client.transport.client import RemoteCache
    from megacache_client.transport.retry import Deadline
    from megacache_client.wire.manifest import component_digest
    from megacache_server.store.index.protocols.entries import NewEntry, Precondition
    from megacache_server.store.index.sqlite import SqliteIndex

    good = make_manifest({"megacache": b"good"})
    bad = json.loads(make_manifest({"megacache": b"bad"}, make_fingerprint(code="old")).to_json())
    bad["producer"] = {"client": "megacache 0.1", "rank": "0\n\x1b[2J"}

    async def store() -> None:  # past the schema, as an older server wrote it
        index = SqliteIndex(tmp_path / "data" / "index.sqlite3")
        await index.open()
        try:
            fp = good.fingerprint
            for manifest_json, at in ((json.dumps(bad).encode(), 1.0),
                                      (good.to_json(), 2.0)):
                doc = json.loads(manifest_json)
                await index.put(NewEntry(
                    key=doc["key"], manifest_json=manifest_json, namespace=fp.namespace,
                    model=fp.model, env_digest=component_digest(fp.env),
                    hw_digest=component_digest(fp.hw),
                    digests=tuple(b["digest"] for b in doc["blobs"]), size=1, created_at=at),
                    Precondition())
        finally:
            await index.close()

    (tmp_path / "data").mkdir()
    asyncio.run(store())
    server = ServerProcess(tmp_path / "data").start()
    try:
        config = ClientConfig(url=server.url, node_cache_dir=tmp_path / "node")
        with caplog.at_level("WARNING", logger="megacache"), \
                RemoteCache(config, CircuitBreaker(), Deadline(30)) as remote:
            listed = remote.list_entries(model=good.fingerprint.model)
    finally:
        server.stop()
    assert [m.key for m in listed] == [good.key]
    assert len([r for r in caplog.records if "listed entry" in r.getMessage()]) == 1


def test_blob_meta_from_a_compilers_banner_is_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack's meta carries the C++ compiler's banner: escaped to the text rule, so the
    manifest the client builds passes its own schema and the server's (#47)."""
    from megacache_client.torch import env as torch_env
    from megacache_client.torch import relocate

    monkeypatch.setattr(torch_env, "cxx_version", lambda: "g++ \x1b[31m13\r")
    relocate.build_facts.cache_clear()  # facts are read once per process: read them anew
    try:
        facts = relocate.build_facts()
        assert facts["cxx"] == "g++ \\x1b[31m13\\r"
        assert all(is_text(v, 256) for v in relocate.build_meta().values())
    finally:
        relocate.build_facts.cache_clear()  # the next reader gets this machine's own


@pytest.mark.parametrize("bidi", ["\u202e", "\u202a", "\u2066", "\u2069"])
def test_a_bidi_control_in_a_fingerprint_value_is_refused_and_escaped_in_tables(
        bidi: str, capsys: pytest.CaptureFixture[str]) -> None:
    """#58: a right-to-left override in a fingerprint value passed the text rule and
    reached the CLI's tables raw, reordering what the row shows."""
    from megacache_client.cli.common import table
    from megacache_client.wire.manifest import Fingerprint
    from megacache_client.wire.schema import SchemaError, parse

    with pytest.raises(SchemaError, match="U\\+"):
        parse(Fingerprint, {"model": "m", "code": "c", "hw": {"gpu": f"A{bidi}100"}})
    table(["model"], [[f"gpt-{bidi}evil"]])
    shown = capsys.readouterr().out
    assert bidi not in shown and "gpt-\\u" in shown, shown
