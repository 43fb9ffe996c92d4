"""Replay vs rebuild: the client's rule (did a run replay the entry's artifacts fully, partly,
or rebuild), and the server's counts of it in `/v1/stats`, `/v1/dashboard` (and the page)
and `/metrics`, on every backend pair, each tenant seeing only its own."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from helpers import ServerProcess, make_fingerprint, make_manifest, token_client
from prometheus_client.parser import text_string_to_metric_families

from megacache_client.results import LoadResult, Track
from megacache_client.steps import report
from megacache_client.torch import env as torch_env
from megacache_client.torch import precompile
from megacache_client.transport.trust import ServedEntry
from megacache_client.wire.events import Event
from megacache_client.wire.schema import parse_json
from megacache_server.store.index import rollups
from megacache_server.store.index.sqlite import SqliteIndex


def counters(fx_hit: int = 0, fx_miss: int = 0, aot_hit: int = 0,
             aot_miss: int = 0) -> dict[str, int]:
    return {"fxgraph_hit": fx_hit, "fxgraph_miss": fx_miss, "aot_hit": aot_hit,
            "aot_miss": aot_miss}


@pytest.mark.parametrize(("outcome", "seen", "served", "expected"), [
    ("hit", counters(fx_hit=4, aot_hit=2), 0, "full"),
    ("fallback", counters(fx_hit=1), 0, "full"),
    ("hit", counters(), 3, "full"),  # precompiled Dynamo served everything
    ("hit", counters(aot_hit=2), 0, "full"),
    ("hit", counters(fx_hit=3, fx_miss=1), 0, "partial"),
    ("fallback", counters(aot_hit=1, aot_miss=1), 0, "partial"),
    ("hit", counters(fx_miss=2), 5, "partial"),
    ("hit", counters(fx_miss=2), 0, "rebuilt"),  # loaded, nothing found in it
    ("hit", counters(), 0, "rebuilt"),  # loaded, nothing compiled nor served
    ("miss", counters(fx_hit=5), 0, "rebuilt"),  # torch's local cache, not the entry
    ("invalid", counters(), 0, "rebuilt"),
    ("error", counters(fx_hit=1), 0, "rebuilt"),
    ("inert", counters(fx_miss=3), 0, "rebuilt"),
])
def test_replay_rule(outcome: Any, seen: dict[str, int], served: int, expected: str):
    assert report.replay(outcome, seen, served) == expected


def track(model: str, outcome: Any) -> Track:
    fp = make_fingerprint(model=model)
    entry = make_manifest({"megacache": b"x"}, fp, cold_compile_s=30.0)
    served = ServedEntry(entry, etag='"e"', provenance=None, asked=entry.key)
    return Track(fp=fp, load=LoadResult(outcome=outcome, key=fp.key(), served=served))


@pytest.mark.parametrize(("seen", "served", "outcome", "expected"), [
    (counters(fx_hit=4), 0, "hit", "full"),
    (counters(fx_hit=4, fx_miss=1), 0, "hit", "partial"),
    (counters(fx_miss=4), 0, "inert", "rebuilt"),  # the hit is reported inert
    (counters(fx_miss=4), 2, "hit", "partial"),  # precompiled Dynamo served: not inert
])
def test_events_carry_the_replay_on_the_first_track_only(
        monkeypatch: pytest.MonkeyPatch, seen: dict[str, int], served: int, outcome: str,
        expected: str):
    monkeypatch.setattr(torch_env, "cache_counters", lambda: seen)
    monkeypatch.setattr(torch_env, "compile_seconds", lambda: 2.0)
    monkeypatch.setattr(precompile, "counters",
                        lambda: {"hit": 0, "miss": 0, "error": 0, "served": served})
    warned: list[str] = []
    first, second = report.events([track("a", "hit"), track("b", "hit")], lambda: {},
                                  warned.append)
    assert (first.outcome, first.replay) == (outcome, expected)
    assert second.replay is None and second.fxgraph_hit == 0
    assert bool(warned) == (outcome == "inert")
    # what the server is sent, and takes back
    assert parse_json(Event, first.to_json()).replay == expected


def test_events_without_a_replay_stay_valid():
    old = parse_json(Event, '{"key": "' + "a" * 64 + '", "model": "m", "outcome": "hit"}')
    assert old.replay is None
    with pytest.raises(ValueError, match="replay"):
        parse_json(Event, '{"key": "' + "a" * 64 + '", "model": "m", "outcome": "hit", '
                        '"replay": "mostly"}')


# -- the server ------------------------------------------------------------------------

def test_an_older_sqlite_index_gains_the_replay_counts(tmp_path: Path):
    """A file written before replays were counted: its rollups get the columns (zeros) when
    this server opens it, and keep the runs they held."""
    path = tmp_path / "index.sqlite3"

    async def add(replay: Literal["full"] | None) -> None:
        ix = SqliteIndex(path)
        await ix.open()
        try:
            await ix.add_event("ns", Event(key="a" * 64, model="m", outcome="hit",
                                           replay=replay))
        finally:
            await ix.close()

    asyncio.run(add(None))
    with sqlite3.connect(path) as c:  # the rollups as a server before replays left them
        for table in ("rollup_hourly", "rollup_daily", "rollup_total"):
            for column in rollups.REPLAY_COUNTERS:
                c.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    asyncio.run(add("full"))

    async def read() -> list[tuple[int, dict[str, int]]]:
        ix = SqliteIndex(path)
        await ix.open()
        try:
            return [(m.runs, m.replays) for since in (None, time.time() - 3600)
                    for m in await ix.stats(namespace="ns", since=since)]
        finally:
            await ix.close()

    assert asyncio.run(read()) == [(2, replays(1, 0, 0))] * 2


def post(c: httpx.Client, model: str, outcome: str, replay: str | None, n: int = 1,
         **fields: object) -> None:
    body: dict[str, object] = {"key": "c" * 64, "model": model, "outcome": outcome,
                               "compile_s": 1.0, **fields}
    if replay is not None:
        body["replay"] = replay
    for _ in range(n):
        r = c.post("/v1/events", json=body)
        assert r.status_code == 202, r.text


def replays(full: int, partial: int, rebuilt: int) -> dict[str, int]:
    return {"full": full, "partial": partial, "rebuilt": rebuilt}


def replay_samples(text: str) -> dict[tuple[str, str], float]:
    """(namespace, replay) -> megacache_replays_total."""
    return {(s.labels["namespace"], s.labels["replay"]): s.value
            for f in text_string_to_metric_families(text) if f.name == "megacache_replays"
            for s in f.samples if s.name == "megacache_replays_total"}


def test_replays_in_stats_dashboard_and_metrics(events_server: ServerProcess):
    team_a = token_client(events_server, "read,write", "replay-a")
    team_b = token_client(events_server, "read,write", "replay-b")
    three_days_ago = (datetime.now(timezone.utc) - timedelta(days=3)).isoformat()
    post(team_a, "llm", "hit", "full", 3)
    post(team_a, "llm", "fallback", "partial")
    post(team_a, "llm", "miss", "rebuilt")
    post(team_a, "llm", "hit", "rebuilt", created_at=three_days_ago)  # outside a day
    post(team_a, "llm", "hit", None)  # an older client: counts as a run, in no replay
    post(team_a, "vit", "hit", "partial", 2)
    post(team_a, "vit", "inert", "rebuilt")
    post(team_b, "secret-model", "hit", "full", 5)
    bad = team_a.post("/v1/events", json={"key": "c" * 64, "model": "llm",
                                          "outcome": "hit", "replay": "mostly"})
    assert bad.status_code == 422, bad.text

    stats = team_a.get("/v1/stats").json()
    models = {m["model"]: m for m in stats["models"]}
    assert set(models) == {"llm", "vit"}
    assert models["llm"]["runs"] == 7 and models["llm"]["replays"] == replays(3, 1, 2)
    assert models["vit"]["runs"] == 3 and models["vit"]["replays"] == replays(0, 2, 1)
    assert stats["total"]["replays"] == replays(3, 3, 3)
    # a window sums the hourly and daily rollups: the run of three days ago is outside it
    day = {m["model"]: m for m in team_a.get("/v1/stats",
                                             params={"since_hours": 24}).json()["models"]}
    assert day["llm"]["replays"] == replays(3, 1, 1)
    week = team_a.get("/v1/dashboard", params={"hours": 168}).json()
    assert {m["model"]: m["replays"] for m in week["models"]} == \
        {"llm": replays(3, 1, 2), "vit": replays(0, 2, 1)}
    assert week["total"]["replays"] == replays(3, 3, 3)
    dash = team_a.get("/v1/dashboard", params={"hours": 24}).json()
    assert {m["model"]: m["replays"] for m in dash["models"]} == \
        {"llm": replays(3, 1, 1), "vit": replays(0, 2, 1)}

    # the operator's scrape: every namespace, summed over its models
    scraped = replay_samples(token_client(events_server, "metrics").get("/metrics").text)
    assert {k: v for k, v in scraped.items() if k[0].startswith("replay-")} == {
        ("replay-a", "full"): 3, ("replay-a", "partial"): 3, ("replay-a", "rebuilt"): 3,
        ("replay-b", "full"): 5, ("replay-b", "partial"): 0, ("replay-b", "rebuilt"): 0}

    # a tenant sees its own figures only
    own = team_b.get("/metrics").text
    assert set(replay_samples(own)) == {("replay-b", r) for r in ("full", "partial", "rebuilt")}
    assert "replay-a" not in own
    b_stats = team_b.get("/v1/stats").json()
    assert b_stats["total"]["replays"] == replays(5, 0, 0)
    assert [m["model"] for m in team_b.get("/v1/dashboard").json()["models"]] == \
        ["secret-model"]
    for path in ("/v1/stats", "/v1/dashboard", "/metrics"):
        assert "secret-model" not in team_a.get(path).text, path


@pytest.mark.e2e
def test_the_dashboard_page_shows_replays_per_model(tmp_path: Path):
    from test_observability import ensure_chromium

    from benchmarks.dashboard_shot import dump_dom

    ensure_chromium()
    server = ServerProcess(tmp_path / "data").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            post(c, "llm", "hit", "full", 4)
            post(c, "llm", "hit", "partial", 2)
            post(c, "llm", "miss", "rebuilt")
            post(c, "vit", "hit", None)
            api = c.get("/v1/dashboard").json()
        dom = dump_dom(server.url + "/", tmp_path / "chromium")
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom, dom[:2000]
    header = re.search(r'data-testid="models"><thead>(.*?)</thead>', dom, re.S)
    assert header and "replay full / partial / rebuilt" in header.group(1)
    shown = {}
    for m in api["models"]:
        row = re.search(rf'<tr data-model="{m["model"]}">(.*?)</tr>', dom, re.S)
        assert row, m["model"]
        shown[m["model"]] = re.findall(r"<td[^>]*>([^<]*)<", row.group(1))[4]
    assert shown == {"llm": "4 / 2 / 1", "vit": "0 / 0 / 0"}
