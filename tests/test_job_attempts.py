"""Job attempts in the index (both backends): each (namespace, job, attempt) counted once
however many ranks report, at its slowest rank's time, moved between histogram buckets as
slower ranks report, with the rollups (never history) answering stats."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from helpers import run

from megacache_client.wire.events import Event
from megacache_client.wire.schema import SchemaError, parse_json
from megacache_server.store.index import rollups
from megacache_server.store.index.base import Index


def ev(model: str = "m", *, job: str | None = None, attempt: int | None = None,
       rank: int | None = None, tts: float | None = None, compile_s: float = 1.0,
       outcome: str = "hit", **fields: object) -> Event:
    body: dict[str, object] = {"key": "a" * 64, "model": model, "outcome": outcome,
                               "compile_s": compile_s, **fields}
    for name, value in (("job_id", job), ("attempt", attempt), ("rank", rank),
                        ("tts_s", tts)):
        if value is not None:
            body[name] = value
    if job is not None:
        body.setdefault("world_size", 4)
    return parse_json(Event, json.dumps(body))


def test_the_new_event_fields_are_validated():
    assert ev(job="job-1.a_b", attempt=3, rank=2).attempt == 3
    for bad in ({"job_id": ""}, {"job_id": "-x"}, {"job_id": "a/b"}, {"job_id": "x" * 129},
                {"job_id": "a:b"}, {"attempt": -1}, {"attempt": 10**6 + 1}, {"rank": 1.5},
                {"world_size": 0}, {"attempt": True}, {"rank": 4, "world_size": 4},
                {"attempt": float("nan")}):
        body = {"key": "a" * 64, "model": "m", "outcome": "hit", **bad}
        with pytest.raises((SchemaError, ValueError)):
            parse_json(Event, json.dumps(body))


def test_quantiles_interpolate_within_buckets():
    counts = [0.0] * (len(rollups.BUCKETS) + 1)
    assert rollups.quantile(counts, 0.5) is None
    counts[rollups.bucket_of(12.0)] = 10  # (10, 15]
    assert rollups.quantile(counts, 0.5) == pytest.approx(12.5)
    counts[-1] = 90
    assert rollups.quantile(counts, 0.9) == rollups.BUCKETS[-1]


def test_each_attempt_counts_once_at_its_slowest_rank(make_index):
    async def body(ix: Index) -> None:
        # job A: attempt 0 on 4 ranks (the slowest 70 s), then attempt 1 (recovery, 8 s)
        for rank, tts in enumerate((5.0, 70.0, 12.0, 3.0)):
            await ix.add_event("ns", ev(job="A", attempt=0, rank=rank, tts=tts,
                                        compile_s=tts / 2, outcome="miss" if tts == 70 else "hit"))
        for rank, tts in enumerate((8.0, 2.0)):
            await ix.add_event("ns", ev(job="A", attempt=1, rank=rank, tts=tts))
        await ix.add_event("ns", ev(tts=20.0))  # no job: a start of its own
        await ix.add_event("ns2", ev(job="A", attempt=0, rank=0, tts=1.0))  # another tenant
        [m] = await ix.stats(namespace="ns")
        assert m.runs == 7 and (m.attempts, m.restarts) == (3, 1)
        start = m.buckets("start")
        assert sum(start) == m.jobs["start_count"] == 2 and min(start) == 0
        assert start[rollups.bucket_of(70.0)] == 1 and start[rollups.bucket_of(20.0)] == 1
        assert m.jobs["start_sum"] == pytest.approx(90.0)
        assert sum(m.buckets("recover")) == 1 and m.jobs["recover_sum"] == pytest.approx(8.0)
        assert m.buckets("recover")[rollups.bucket_of(8.0)] == 1
        assert sum(m.buckets("compile")) == 3
        assert m.jobs["compile_sum"] == pytest.approx(35.0 + 1.0 + 1.0)
        # windows read the same rollups
        [w] = await ix.stats(namespace="ns", since=time.time() - 3600)
        assert w.buckets("start") == start and w.attempts == 3
        [other] = await ix.stats(namespace="ns2")
        assert other.attempts == 1 and other.buckets("start")[0] == 1

        jobs = await ix.recent_jobs(namespace="ns", limit=10)
        assert [j.job_id for j in jobs] == ["A"] and jobs[0].namespace == "ns"
        a1, a0 = jobs[0].attempts
        assert (a0.attempt, a0.tts_s, a0.outcome, a0.reports, a0.world_size) == \
            (0, 70.0, "miss", 4, 4)
        assert a0.compile_s == 35.0 and (a1.attempt, a1.tts_s) == (1, 8.0)
        [theirs] = await ix.recent_jobs(namespace="ns2", limit=10)
        assert theirs.attempts[0].tts_s == 1.0  # same job id, another tenant's record
        assert len(await ix.recent_jobs(namespace=None, limit=10)) == 2

        await ix.prune_events(raw_before=time.time() + 1, rollups_before=0)
        assert await ix.recent_jobs(namespace="ns", limit=10) == []
        [m] = await ix.stats(namespace="ns")
        assert m.attempts == 3  # the counts stay

    run(make_index, body)


def test_ranks_reporting_at_once_count_once(make_index):
    async def body(ix: Index) -> None:
        await asyncio.gather(*(ix.add_event("ns", ev(job="J", attempt=0, rank=r,
                                                       tts=float(r + 1), world_size=16))
                               for r in range(16)))
        [m] = await ix.stats(namespace="ns")
        assert m.runs == 16 and m.attempts == 1 and sum(m.buckets("start")) == 1
        assert m.buckets("start")[rollups.bucket_of(16.0)] == 1
        assert m.jobs["start_sum"] == pytest.approx(16.0)

    run(make_index, body)


def test_an_older_sqlite_file_gains_the_job_counters(tmp_path):
    """A store made before the job counters existed opens with them as zeros and counts."""
    import sqlite3

    from megacache_server.store.index.sqlite import SqliteIndex

    path = tmp_path / "index.sqlite3"

    async def make() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        await ix.add_event("ns", ev(tts=3.0))
        await ix.close()

    asyncio.run(make())
    with sqlite3.connect(path) as c:
        for table in ("rollup_hourly", "rollup_daily", "rollup_total"):
            for column in rollups.JOB_COUNTERS:
                c.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        c.execute("DROP TABLE job_attempts")

    async def reopen() -> None:
        ix = SqliteIndex(path)
        await ix.open()
        await ix.add_event("ns", ev(job="J", attempt=2, tts=30.0))
        [m] = await ix.stats(namespace="ns")
        assert m.runs == 2 and m.attempts == 1 and m.restarts == 1
        assert [j.job_id for j in await ix.recent_jobs(namespace="ns", limit=5)] == ["J"]
        await ix.close()

    asyncio.run(reopen())


def test_job_records_are_bounded(make_index, monkeypatch):
    """At most MAX_JOBS jobs' records per namespace (the latest reporting), whatever a
    tenant sends; the rollups keep counting every attempt."""
    monkeypatch.setattr(rollups, "MAX_JOBS", 3)

    async def body(ix: Index) -> None:
        for n in range(6):
            await ix.add_event("ns", ev(job=f"job{n}", attempt=0, tts=1.0))
            await asyncio.sleep(0.01)  # distinct report times
        await ix.add_event("other", ev(job="mine", attempt=0, tts=1.0))
        await ix.prune_events(raw_before=0, rollups_before=0)
        jobs = await ix.recent_jobs(namespace="ns", limit=10)
        assert [j.job_id for j in jobs] == ["job5", "job4", "job3"]
        assert [j.job_id for j in await ix.recent_jobs(namespace="other", limit=10)] == ["mine"]
        [m] = await ix.stats(namespace="ns")
        assert m.attempts == 6

    run(make_index, body)


def test_histogram_text_parses_whatever_the_model_name():
    """/metrics writes the job histograms as text itself: label values are escaped (foreign
    control characters as Python escapes first, then Prometheus's own quoting), buckets are
    cumulative and end in _count."""
    from prometheus_client.parser import text_string_to_metric_families

    from megacache_client.wire.text import escape_foreign
    from megacache_server.service.observability.metrics import _job_histograms
    from megacache_server.store.index.base import ModelStats

    m = ModelStats("ns", 'a "model"\\ with\na newline')
    m.jobs[rollups.bucket_counter("start", 3)] = 2.0
    m.jobs[rollups.bucket_counter("start", len(rollups.BUCKETS))] = 1.0
    m.jobs["start_sum"] = 4000.0
    families = {f.name: f for f in text_string_to_metric_families(_job_histograms([m]).decode())}
    start = families["megacache_run_first_step_seconds"]
    assert start.type == "histogram"
    values = {s.labels.get("le", s.name.rsplit("_", 1)[1]): s.value for s in start.samples}
    assert {s.labels["model"] for s in start.samples} == {escape_foreign(m.model)}
    assert all("\n" not in s.labels["model"] for s in start.samples)
    assert values["5.0"] == 0 and values["10.0"] == 2 and values["+Inf"] == 3
    assert values["count"] == 3 and values["sum"] == 4000.0
