"""The fleet over time (#60): ETT per hour and day as bounded rollups, each backend.

- A roll (`service.ett_roller.Roller`) adds each job's part of each hour to the rows, and
  after any history (a job that runs on, then fails, then recovers) the rows hold exactly
  the sum of the jobs' splits: the seconds by category, the failures by cause and their
  cost, the starts and recoveries;
- a roll whose job's contribution changed meanwhile is skipped, never added twice;
- the jobs that lost the most, and pruning;
- over HTTP: `GET /v1/ett/trend` and `megacache jobs --trend` from a real server rolling
  on its own, and the bad periods refused.

How fast a month of 20,000 jobs reads is a benchmark (benchmarks/ett_trend_bench.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
from helpers import ServerProcess, run

from megacache_client.wire.progress import ProgressRecord
from megacache_server.service.ett import causes as ett_causes
from megacache_server.service.ett import split as ett
from megacache_server.service.ett import trend as ett_trend
from megacache_server.service.ett.roller import Roller
from megacache_server.store.index.base import Index
from megacache_server.store.index.ett_rollups import COUNTERS, Contribution, Roll, add
from megacache_server.store.index.rollups import DAY, HOUR

NOW = time.time()
BASE = (NOW - 3 * DAY) // HOUR * HOUR + 1800.0
"""Three days ago, half past the hour: the jobs cross hours and days."""


def rec(kind: str, at: float, **fields: object) -> ProgressRecord:
    return ProgressRecord(kind=kind, at=at, **fields)  # type: ignore[arg-type]


def attempt(start: float, train: float, last: float, *, end: str | None = None,
            cause: str | None = None, save: float | None = None) -> list[ProgressRecord]:
    out = [rec("start", start), rec("training", train), rec("heartbeat", last, step=10)]
    if save is not None:
        out.append(rec("checkpoint_save", save, step=5, blocking_s=2.0))
    if end is not None:
        out.append(rec("end", last, reason=end, cause=cause))
    return out


async def split_of(index: Index, ns: str, job: str) -> ett.JobSplit:
    found = await index.job_progress(ns, job)
    assert found is not None
    return ett.split(found, now=time.time())


def named(vec: list[float]) -> dict[str, float]:
    """A row's vector as its non-zero counters by name."""
    return {k: v for k, v in zip(COUNTERS, vec, strict=True) if v}


def sums(rows: list[tuple[str, str, int, list[float]]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for *_, vec in rows:
        add(total, named(vec))
    return total


def test_the_rows_hold_the_sum_of_the_jobs_whatever_their_history(
        make_index: Callable[[], Index]) -> None:
    async def body(index: Index) -> None:
        roller = Roller(index, 60.0, 14.0)
        await index.add_progress("team", "long", 0, "llm",
                                 attempt(BASE, BASE + 300, BASE + 3 * HOUR, save=BASE + HOUR),
                                 NOW)
        await index.add_progress("team", "short", 0, "vit",
                                 attempt(BASE + DAY, BASE + DAY + 60, BASE + DAY + 900,
                                         end="failed", cause="oom"), NOW)
        assert await roller.roll_once() == 2
        await check(index, ["long", "short"])
        # the long job fails (killed, run again 10 min later) and recovers: a roll moves its
        # training to lost progress in the hours it already counted, nothing twice
        await index.add_progress("team", "long", 1, "llm",
                                 attempt(BASE + 3 * HOUR + 600, BASE + 3 * HOUR + 700,
                                         BASE + 5 * HOUR, end="finished"), time.time())
        assert await roller.roll_once() == 1  # only the job that reported
        assert await roller.roll_once() == 0  # nothing changed since
        await check(index, ["long", "short"])

    run(make_index, body)


async def check(index: Index, jobs: list[str]) -> None:
    splits = [await split_of(index, "team", job) for job in jobs]
    hourly = await index.ett_rows(namespace="team", period="h", since=int(BASE - DAY),
                                  until=int(NOW + DAY))
    daily = await index.ett_rows(namespace="team", period="d", since=int(BASE - 2 * DAY),
                                 until=int(NOW + DAY))
    want = ett.total(s.seconds for s in splits)
    for rows in (hourly, daily):
        got = sums(rows)
        for category, seconds in want.items():
            assert abs(got.get(f"s_{category}", 0.0) - seconds) < 1e-3, (category, got, want)
        causes = ett_causes.add_causes(s.totals.by_cause for s in splits)
        for cause, (n, lost, recovery) in causes.items():
            assert got[f"f_{cause}"] == n and abs(got[f"u_{cause}"] - lost) < 1e-3
            assert abs(got.get(f"r_{cause}", 0.0) - recovery) < 1e-3
        assert not {k for k, v in got.items() if k.startswith("f_") and v
                    and k[2:] not in causes}, got
        assert got["tts_count"] == len(splits)
        assert got.get("ttr_count", 0) == sum(len(s.recoveries()) for s in splits)
    # each hour's seconds are the split's segments within that hour
    (long,) = [s for s in splits if s.job == "long"]
    hour = int(BASE // HOUR * HOUR + HOUR)
    (row,) = [named(c) for _, m, start, c in hourly if m == "llm" and start == hour]
    clipped = ett.clip(long.segments, hour, hour + HOUR)
    assert all(abs(row.get(f"s_{k}", 0.0) - v) < 1e-3 for k, v in clipped.items())
    trend = ett_trend.trend(daily, "d", int(BASE - 2 * DAY), int(NOW), [])
    assert trend["ett_pct"] == ett.ett_pct(want)
    assert trend["failures"] == sum(s.totals.failures for s in splits)


def test_a_stale_roll_is_skipped_and_the_top_jobs_and_pruning(
        make_index: Callable[[], Index]) -> None:
    async def body(index: Index) -> None:
        hour = int(BASE // HOUR * HOUR)
        first = Contribution("m", {hour: {"s_training": 10.0}}, lost_s=5.0, last_seen=NOW)
        second = Contribution("m", {hour: {"s_training": 30.0, "s_lost_progress": 4.0}},
                              lost_s=40.0, last_seen=NOW)
        assert await index.roll_ett([Roll("ns", "a", None, first)]) == 1
        # a roller that read nothing (stale) cannot add `first` again
        assert await index.roll_ett([Roll("ns", "a", None, first)]) == 0
        assert await index.roll_ett([Roll("ns", "a", first, second),
                                     Roll("ns", "b", None, Contribution(
                                         "m", {hour: {"s_training": 1.0}}, 1.0, NOW - DAY))]) == 2
        ((_, model, start, row),) = await index.ett_rows(namespace="ns", period="h",
                                                          since=hour, until=hour, model="m")
        assert (model, start, named(row)) == ("m", hour, {"s_training": 31.0,
                                                         "s_lost_progress": 4.0})
        top = await index.ett_top_lost(namespace="ns", since=NOW - 2 * DAY, limit=5)
        assert [(j, lost) for _, j, _, lost, _ in top] == [("a", 40.0), ("b", 1.0)]
        assert [j for _, j, *_ in await index.ett_top_lost(namespace="ns", since=NOW - 60,
                                                            limit=5)] == ["a"]
        assert await index.ett_models("ns") == {"m"}
        assert (await index.ett_contributions([("ns", "a")]))[("ns", "a")] == second
        await index.prune_ett(NOW, NOW - 3600)  # b has not reported for a day
        assert set(await index.ett_contributions([("ns", "a"), ("ns", "b")])) == {("ns", "a")}
        # what b added stays in the rows: the trend keeps the past
        assert sums(await index.ett_rows(namespace="ns", period="h", since=hour,
                                         until=hour))["s_training"] == 31.0

    run(make_index, body)


def test_the_trend_over_http_and_in_megacache_jobs(tmp_path: object) -> None:
    server = ServerProcess(tmp_path / "data",  # type: ignore[operator]
                           env={"MEGACACHE_ETT_ROLL_S": "0.5"}).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for a, records in enumerate((
                    [{"kind": "start", "at": BASE}, {"kind": "training", "at": BASE + 30},
                     {"kind": "heartbeat", "at": BASE + 400, "step": 9},
                     {"kind": "end", "at": BASE + 400, "reason": "failed",
                      "cause": "preempted", "detail": "SIGTERM"}],
                    [{"kind": "start", "at": BASE + 460}, {"kind": "training", "at": BASE + 500},
                     {"kind": "end", "at": BASE + 900, "reason": "finished"}])):
                r = c.post("/v1/jobs/trend-job/progress",
                           json={"attempt": a, "records": records, "model": "llm"})
                assert r.status_code == 202, r.text
            deadline = time.monotonic() + 30
            while True:
                found = c.get("/v1/ett/trend", params={"days": 5}).json()
                # both attempts rolled (a roll may come between the two posts)
                if found["time_to_recover"]["n"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            job = c.get("/v1/jobs/trend-job/ett").json()
            assert found["failures_by_cause"] == [{"cause": "preempted", "failures": 1,
                                                   "unsaved_training_s": 370.0,
                                                   "recovery_s": 100.0}], found
            assert found["seconds"] == job["seconds"] and found["ett_pct"] == job["ett_pct"]
            day = [p for p in found["series"] if p["wall_s"]]
            assert len(day) == 1 and day[0]["start"] == BASE // DAY * DAY
            assert found["time_to_start"]["n"] == 1 and found["time_to_recover"]["n"] == 1
            assert found["top_lost"][0]["job_id"] == "trend-job"
            assert found["top_lost"][0]["lost_s"] == 470.0  # 370 s lost + 100 s recovering
            (ns,) = found["namespaces"]
            assert ns["namespace"] == "default" and ns["seconds"] == found["seconds"]
            (model,) = found["models"]
            assert model["model"] == "llm" and model["failures"] == 1
            hours = c.get("/v1/ett/trend", params={"days": 5, "period": "hour"}).json()
            assert hours["seconds"] == job["seconds"] and len(hours["series"]) >= 5 * 24
            for bad in ({"period": "week"}, {"period": "hour", "days": 30}, {"days": 0},
                        {"days": 401}):
                assert c.get("/v1/ett/trend", params=bad).status_code == 422, bad
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
        out = subprocess.run([sys.executable, "-m", "megacache_client.cli", "jobs", "--trend",
                              "--days", "5"], capture_output=True, text=True, timeout=120,
                             env={**env, "MEGACACHE_URL": server.url})
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        row = next(line.split() for line in lines if line.startswith("TOTAL"))
        assert row[1] == f"{job['ett_pct']:.1f}" and row[5:7] == ["1", "preempted:1"], lines
        assert any(line.startswith("trend-job") for line in lines), lines
    finally:
        server.stop()
