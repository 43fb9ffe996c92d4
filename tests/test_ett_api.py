"""ETT on a real server, on every backend pair: progress in, the job's split out (the same
numbers as worked out by hand), in /v1/jobs, /v1/stats, the dashboard and /metrics; every
bad field refused with nothing stored; tenants never see each other's jobs; floods get 429."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import ServerProcess, token_client
from prometheus_client.parser import text_string_to_metric_families

from megacache_client.wire import routes
from megacache_client.wire.progress import MAX_AGE_S, MAX_RECORDS, MAX_SKEW_S


@pytest.fixture(scope="module", params=BACKENDS)
def ett_server(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("ett") / "data", *args, "--auth",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_EVENT_RATE": "1000",
             "MEGACACHE_EVENT_BURST": "1000", "MEGACACHE_PROGRESS_RATE": "1",
             "MEGACACHE_PROGRESS_BURST": "60"}), request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def post(c: httpx.Client, job: str, attempt: int, records: list[dict[str, Any]],
         **extra: Any) -> httpx.Response:
    return c.post(routes.JOB_PROGRESS.url(job=job),
                  json={"attempt": attempt, "records": records, **extra})


def timeline(base: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The killed-then-recovered job of test_ett_split, from `base` (1000 s long): attempt 0
    lived until its second save was durable (404 s)."""
    first = [{"kind": "start", "at": base, "allocation_start": base},
             {"kind": "training", "at": base + 30},
             {"kind": "checkpoint_save", "at": base + 100, "step": 70, "blocking_s": 4.0},
             {"kind": "checkpoint_save", "at": base + 300, "step": 250, "blocking_s": 4.0,
              "background_s": 100.0},
             {"kind": "heartbeat", "at": base + 350, "step": 300}]
    second = [{"kind": "start", "at": base + 400},
              {"kind": "checkpoint_load", "at": base + 410, "blocking_s": 20.0, "step": 70},
              {"kind": "training", "at": base + 450, "phases": [
                  {"phase": "distributed", "at": base + 402, "seconds": 3.0, "count": 2},
                  {"phase": "model_build", "at": base + 405, "seconds": 4.0},
                  {"phase": "first_batch", "at": base + 430, "seconds": 5.0}]},
              {"kind": "checkpoint_save", "at": base + 700, "step": 500, "blocking_s": 6.0},
              {"kind": "end", "at": base + 1000, "reason": "finished"}]
    return first, second


WANT = {"training": 810.0, "data_wait": 0.0, "startup": 30.0, "compile": 10.0,
        "checkpoint_save": 14.0, "checkpoint_restore": 20.0, "lost_progress": 100.0,
        "recovery": 16.0, "idle": 0.0}
RECOVERY = {"allocation_wait": 0.0, "restart_wait": 0.0, "imports": 0.0, "distributed": 1.0,
            "model_build": 4.0, "checkpoint_restore": 20.0, "first_batch": 5.0,
            "compile": 10.0, "first_step": 5.0, "other": 1.0}
"""Attempt 1's 46 s from the failure (404 s) to its first step (450 s), by component: its
process started at 400 s (no wait after the failure), its process groups' 3 s from 402 s
are 1 s after the failure, the first step runs from the first batch (435 s), compile aside
(440-450 s); 409-410 s is nobody's."""


def test_progress_in_split_out_everywhere(ett_server: ServerProcess) -> None:
    team_a = token_client(ett_server, "read,write", "team-a")
    team_b = token_client(ett_server, "read,write", "team-b")
    base = time.time() - 1100
    first, second = timeline(base)
    # sent in several batches, one of them twice (a client retrying), out of order
    for batch in (first[:2], first[2:], first[2:]):
        r = post(team_a, "run-1", 0, batch, model="llm")
        assert r.status_code == 202 and r.json()["records"] == len(batch), r.text
    assert post(team_a, "run-1", 1, second[::-1]).status_code == 202
    # attempt 1 compiled 10 s (the events' job attempts)
    event = {"key": "b" * 64, "model": "llm", "outcome": "miss", "compile_s": 10.0,
             "job_id": "run-1", "attempt": 1, "rank": 0, "world_size": 1}
    assert team_a.post("/v1/events", json=event).status_code == 202

    got = team_a.get(routes.JOB_ETT.url(job="run-1"))
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["seconds"] == WANT and body["wall_s"] == 1000.0 and body["ett_pct"] == 81.0
    assert body["failures"] == 1 and body["lost_s_per_failure"] == [100.0]
    # the report's words, the same numbers
    assert (body["time_to_start_s"], body["time_to_recover_s"], body["checkpoint_save_s"],
            body["unsaved_training_s"]) == (30.0, 46.0, 14.0, 100.0)
    assert body["model"] == "llm" and body["namespace"] == "team-a" and not body["live"]
    a0, a1 = body["attempts"]
    assert a0["failed"] and a0["time_to_start_s"] == 30.0 and a0["lost_s"] == 100.0
    assert a1["time_to_recover_s"] == 46.0 and a1["ended"] == "finished"
    # no end record, and nothing later from its node: lost; what it cost, by cause
    assert (a0["cause"], a1["cause"]) == ("lost", None), (a0, a1)
    assert body["failures_by_cause"] == [{"cause": "lost", "failures": 1,
                                          "unsaved_training_s": 100.0, "recovery_s": 46.0}]
    assert a1["components"] == {"seconds": RECOVERY, "process_groups": 2}
    assert sum(a0["components"]["seconds"].values()) == a0["time_to_start_s"] == 30.0
    assert a0["cache"] is None and a1["cache"] == {"outcome": "miss", "compile_s": 10.0,
                                                   "tts_s": None, "ranks": 1}
    advice = body["advice"]
    assert advice["failures"] == 1 and advice["saves"] == 3
    assert advice["blocking_per_save_s"] == pytest.approx(14 / 3, abs=1e-3)
    assert advice["confidence"] == "low"

    # the last 200 s of the job: attempt 1's training from 900 to 1000 (its end) is all
    # that lies in them, as long as the test takes under 100 s
    window = team_a.get(routes.JOB_ETT.url(job="run-1"), params={"since": 200}).json()
    assert window["seconds"] == WANT and window["window"]["ett_pct"] == 100.0
    assert 99 <= window["window"]["wall_s"] <= 101
    assert team_a.get(routes.JOB_ETT.url(job="run-1"), params={"since": -1}).status_code == 422

    # another tenant: the same id is nobody's job there, and its own is its own
    assert team_b.get(routes.JOB_ETT.url(job="run-1")).status_code == 404
    assert post(team_b, "run-1", 0, [{"kind": "start", "at": base}]).status_code == 202
    assert team_a.get(routes.JOB_ETT.url(job="run-1")).json()["seconds"] == WANT
    assert team_b.get(routes.JOB_ETT.url(job="run-1")).json()["namespace"] == "team-b"

    jobs = team_a.get("/v1/jobs").json()["jobs"]
    (row,) = [j for j in jobs if j["job_id"] == "run-1"]
    assert row["ett"]["ett_pct"] == 81.0 and row["ett"]["seconds"] == WANT
    assert all(j["namespace"] == "team-a" for j in jobs)
    stats = team_a.get("/v1/stats").json()["ett"]
    assert stats["jobs"] == 1 and stats["ett_pct"] == 81.0
    assert stats["time_to_recover"] == {"n": 1, "p50_s": 46.0, "p90_s": 46.0}
    (model,) = stats["models"]
    assert model["model"] == "llm" and model["advice"]["failures"] == 1
    assert model["failures_by_cause"] == body["failures_by_cause"]
    assert stats["namespaces"][0]["failures_by_cause"] == body["failures_by_cause"]
    assert model["components"]["recover"]["checkpoint_restore"] == {
        "n": 1, "p50_s": 20.0, "p90_s": 20.0}
    assert model["components"]["recover"]["process_groups"]["p50_s"] == 2
    dash = team_a.get("/v1/dashboard").json()["ett"]
    assert dash["ett_pct"] == 81.0 and dash["shown"][0]["job_id"] == "run-1"
    assert dash["shown"][0]["seconds"] == WANT
    assert dash["shown"][0]["time_to_recover_s"] == 46.0
    assert [b["kind"] for b in dash["shown"][0]["starts"]] == ["start", "recover"]
    assert dash["shown"][0]["starts"][1]["seconds"] == RECOVERY
    assert dash["shown"][0]["starts"][1]["cause"] == "lost"

    scrape = token_client(ett_server, "metrics").get("/metrics").text
    seconds, lost, causes, parts = {}, {}, {}, {}
    for family in text_string_to_metric_families(scrape):
        for s in family.samples:
            if s.name == "megacache_job_seconds_total" and s.labels["namespace"] == "team-a":
                seconds[s.labels["category"]] = s.value
            if s.name.startswith("megacache_job_failure") \
                    and s.labels["namespace"] == "team-a":
                causes[(s.name, s.labels["cause"])] = s.value
            if s.name == "megacache_job_start_component_seconds_total" \
                    and s.labels["namespace"] == "team-a" and s.labels["kind"] == "recover":
                parts[s.labels["component"]] = s.value
            if s.name.startswith(("megacache_job_lost_seconds", "megacache_job_time_to_")) \
                    and s.labels["namespace"] == "team-a":
                lost[s.name + s.labels.get("le", "")] = s.value
    assert seconds == WANT
    # failures by cause: every cause a series (increase() sees the first failure)
    assert causes[("megacache_job_failures_total", "lost")] == 1
    assert causes[("megacache_job_failure_unsaved_seconds_total", "lost")] == 100.0
    assert causes[("megacache_job_failure_recovery_seconds_total", "lost")] == 46.0
    assert sum(v for (n, _), v in causes.items() if n == "megacache_job_failures_total") == 1
    assert len(causes) == 3 * 8 and parts == RECOVERY
    assert 'megacache_model_time_to_start_seconds{namespace="team-a",model="llm",' \
           'quantile="0.5"} 30.0' in scrape
    # time to start and to recover: the job's own figures (ETT's), as histograms
    assert (lost["megacache_job_time_to_start_seconds_count"],
            lost["megacache_job_time_to_start_seconds_sum"]) == (1, 30.0)
    assert (lost["megacache_job_time_to_recover_seconds_count"],
            lost["megacache_job_time_to_recover_seconds_sum"]) == (1, 46.0)
    assert lost["megacache_job_time_to_recover_seconds_bucket45.0"] == 0
    assert lost["megacache_job_time_to_recover_seconds_bucket60.0"] == 1
    assert lost["megacache_job_lost_seconds_count"] == 1
    assert lost["megacache_job_lost_seconds_sum"] == 100.0
    assert "megacache_checkpoint_blocking_seconds_bucket" in scrape
    # team B sees its own job and nothing of team A's, wherever it looks
    b_scrape = team_b.get("/metrics").text
    assert 'namespace="team-b"' in b_scrape and 'namespace="team-a"' not in b_scrape
    assert [j["namespace"] for j in team_b.get("/v1/jobs").json()["jobs"]] == ["team-b"]
    b_ett = team_b.get("/v1/stats").json()["ett"]
    assert b_ett["jobs"] == 1 and b_ett["models"][0]["model"] is None
    assert [j["namespace"] for j in team_b.get("/v1/dashboard").json()["ett"]["shown"]] == [
        "team-b"]

    # a job reporting again is split again (splits are remembered until it does)
    before = team_a.get("/v1/jobs").json()["jobs"]
    assert post(team_a, "run-1", 2, [{"kind": "start", "at": base + 1050}]).status_code == 202
    after = next(j for j in team_a.get("/v1/jobs").json()["jobs"] if j["job_id"] == "run-1")
    assert after["ett"]["failures"] == 2 and after["ett"]["wall_s"] == 1050.0
    assert next(j for j in before if j["job_id"] == "run-1")["ett"]["failures"] == 1


def bad_batches(now: float) -> dict[str, Any]:
    ok = {"kind": "heartbeat", "at": now, "step": 1}
    return {
        "nan time": '{"attempt": 0, "records": [{"kind": "heartbeat", "at": NaN, "step": 1}]}',
        "infinite blocking": json.dumps({"attempt": 0, "records": [
            {"kind": "checkpoint_save", "at": now, "step": 1, "blocking_s": math.inf}]}),
        "negative blocking": {"attempt": 0, "records": [
            {"kind": "checkpoint_save", "at": now, "step": 1, "blocking_s": -1.0}]},
        "negative background": {"attempt": 0, "records": [
            {"kind": "checkpoint_save", "at": now, "step": 1, "blocking_s": 1.0,
             "background_s": -5.0}]},
        "huge blocking": {"attempt": 0, "records": [
            {"kind": "checkpoint_load", "at": now, "blocking_s": 8 * 24 * 3600.0}]},
        "future": {"attempt": 0, "records": [ok | {"at": now + MAX_SKEW_S + 120}]},
        "far past": {"attempt": 0, "records": [ok | {"at": now - MAX_AGE_S - 86400}]},
        "future allocation": {"attempt": 0, "records": [
            {"kind": "start", "at": now, "allocation_start": now + 60}]},
        "ancient allocation": {"attempt": 0, "records": [
            {"kind": "start", "at": now, "allocation_start": now - MAX_AGE_S - 86400}]},
        "negative step": {"attempt": 0, "records": [ok | {"step": -1}]},
        "missing step": {"attempt": 0, "records": [{"kind": "heartbeat", "at": now}]},
        "missing reason": {"attempt": 0, "records": [{"kind": "end", "at": now}]},
        "bad reason": {"attempt": 0, "records": [{"kind": "end", "at": now,
                                                   "reason": "bored"}]},
        "unknown kind": {"attempt": 0, "records": [ok | {"kind": "lunch"}]},
        "unknown field": {"attempt": 0, "records": [ok | {"gpu": "h100"}]},
        "negative attempt": {"attempt": -1, "records": [ok]},
        "no records": {"attempt": 0, "records": []},
        "too many records": {"attempt": 0, "records": [ok] * (MAX_RECORDS + 1)},
        "long model": {"attempt": 0, "records": [ok], "model": "m" * 257},
        "unknown cause": {"attempt": 0, "records": [
            {"kind": "end", "at": now, "reason": "failed", "cause": "cosmic rays"}]},
        "lost from a client": {"attempt": 0, "records": [
            {"kind": "failure", "at": now, "cause": "lost"}]},
        "failure without a cause": {"attempt": 0, "records": [{"kind": "failure", "at": now}]},
        "long detail": {"attempt": 0, "records": [
            {"kind": "end", "at": now, "reason": "failed", "cause": "exception",
             "detail": "E" * 201}]},
        "control characters in a detail": {"attempt": 0, "records": [
            {"kind": "end", "at": now, "reason": "failed", "cause": "exception",
             "detail": "a\x1b[31mb"}]},
        "string exit code": {"attempt": 0, "records": [
            {"kind": "end", "at": now, "reason": "failed", "cause": "exit_code",
             "exit_code": "3"}]},
        "unknown phase": {"attempt": 0, "records": [
            {"kind": "training", "at": now, "phases": [
                {"phase": "coffee", "at": now, "seconds": 1.0}]}]},
        "negative phase": {"attempt": 0, "records": [
            {"kind": "training", "at": now, "phases": [
                {"phase": "distributed", "at": now, "seconds": -1.0}]}]},
        "too many phases": {"attempt": 0, "records": [
            {"kind": "training", "at": now, "phases": [
                {"phase": "distributed", "at": now, "seconds": 1.0}] * 65}]},
        "string time": {"attempt": 0, "records": [ok | {"at": "yesterday"}]},
        "not json": "{attempt: 0",
        "not an object": "[1, 2]",
    }


def test_every_bad_field_is_refused_and_nothing_is_stored(ett_server: ServerProcess) -> None:
    c = token_client(ett_server, "read,write", "team-bad")
    for i, (name, body) in enumerate(bad_batches(time.time()).items()):
        job = f"bad-{i}"
        content = body if isinstance(body, str) else json.dumps(body)
        r = c.post(routes.JOB_PROGRESS.url(job=job), content=content,
                   headers={"content-type": "application/json"})
        assert r.status_code == 422, (name, r.status_code, r.text)
        assert r.json()["error"]["code"] in ("invalid_progress", "malformed_json"), (name,
                                                                                  r.text)
        assert c.get(routes.JOB_ETT.url(job=job)).status_code == 404, name
    r = post(c, "bad-future", 0, [{"kind": "heartbeat", "at": time.time() + 3600, "step": 1}])
    assert "ahead of the server's clock" in r.json()["error"]["message"]
    for job in ("-starts-with-dash", "has space", "x" * 129, "a/b", "..", "sémantique"):
        r = c.post("/v1/jobs/" + httpx.URL(job).raw_path.decode() + "/progress",
                   json={"attempt": 0, "records": [{"kind": "start", "at": time.time()}]})
        assert r.status_code in (404, 422), (job, r.status_code)
    assert c.get("/v1/jobs").json()["jobs"] == []
    big = json.dumps({"attempt": 0, "records": [{"kind": "start", "at": time.time()}],
                      "model": "m" * 200_000})
    r = c.post(routes.JOB_PROGRESS.url(job="big"), content=big,
               headers={"content-type": "application/json"})
    assert r.status_code == 413
    # a read token may look but not report
    reader = token_client(ett_server, "read", "team-bad")
    r = post(reader, "ro", 0, [{"kind": "start", "at": time.time()}])
    assert r.status_code == 403
    assert token_client(ett_server, "read", "team-bad").get(
        routes.JOB_ETT.url(job="ro")).status_code == 404


def test_a_flood_gets_429_and_stays_bounded(ett_server: ServerProcess) -> None:
    c = token_client(ett_server, "read,write", "team-flood")
    now = time.time()
    codes = []
    for i in range(80):
        records = [{"kind": "checkpoint_save", "at": now - 2000 + i * 8 + k * 0.01,
                    "step": i * MAX_RECORDS + k, "blocking_s": 0.001}
                   for k in range(MAX_RECORDS)]
        r = post(c, "flood", 0, [{"kind": "start", "at": now - 2100}] + records[1:])
        codes.append(r.status_code)
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "rate_limited"
    assert 202 in codes and 429 in codes, codes
    body = c.get(routes.JOB_ETT.url(job="flood")).json()
    (attempt,) = body["attempts"]
    assert attempt["checkpoint_saves"] == codes.count(202) * (MAX_RECORDS - 1)
    assert 0 <= body["ett_pct"] <= 100
    # another token of the same namespace is not held back by the flood
    other = token_client(ett_server, "read,write", "team-flood")
    assert post(other, "calm", 0, [{"kind": "start", "at": now}]).status_code == 202


def test_a_killed_attempt_is_dated_by_its_last_durable_save(ett_server: ServerProcess
                                                             ) -> None:
    """The issue's timeline (#46), over HTTP with the default heartbeat: start t0, first
    step t0+10, heartbeats t0+35/65, saves at t0+40 (1 s) and t0+70 (1 s blocking + 2 s in
    the background), then nothing (SIGKILL); a restart at t0+90. The second save's record
    went out once it was durable (t0+73): the attempt lived until then. The server said
    29 s lost and 1.0 s of save blocking; the truth is at most ~9 s and exactly 2.0 s."""
    c = token_client(ett_server, "read,write", "team-kill")
    t0 = time.time() - 200
    first = [{"kind": "start", "at": t0}, {"kind": "training", "at": t0 + 10},
             {"kind": "heartbeat", "at": t0 + 35, "step": 20},
             {"kind": "checkpoint_save", "at": t0 + 40, "step": 25, "blocking_s": 1.0},
             {"kind": "heartbeat", "at": t0 + 65, "step": 50},
             {"kind": "checkpoint_save", "at": t0 + 70, "step": 55, "blocking_s": 1.0,
              "background_s": 2.0}]
    for batch in (first[:3], first[3:5], first[5:]):  # as the client sends them
        assert post(c, "killed", 0, batch).status_code == 202
    assert post(c, "killed", 1, [{"kind": "start", "at": t0 + 90},
                                 {"kind": "training", "at": t0 + 100}]).status_code == 202
    body = c.get(routes.JOB_ETT.url(job="killed")).json()
    a0 = body["attempts"][0]
    assert a0["failed"] and a0["end"] == pytest.approx(t0 + 73, abs=1e-3), a0
    assert (a0["lost_s"], a0["checkpoint_blocking_s"]) == (2.0, 2.0), a0
    assert body["unsaved_training_s"] == 2.0 and body["checkpoint_save_s"] == 2.0
    assert body["time_to_recover_s"] == 27.0


def test_megacache_jobs_prints_each_jobs_split(ett_server: ServerProcess) -> None:
    token = ett_server.token("read,write", namespace="team-cli", name="cli")
    c = token_client(ett_server, "read,write", "team-cli")
    first, second = timeline(time.time() - 1100)
    assert post(c, "cli-job", 0, first, model="llm").status_code == 202
    assert post(c, "cli-job", 1, second).status_code == 202
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    env |= {"MEGACACHE_URL": ett_server.url, "MEGACACHE_TOKEN": token}

    def megacache(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "megacache_client.cli", *args],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    table = megacache("jobs").splitlines()
    assert table[0].split() == ["job", "model", "ETT", "%", "wall", "s", "time", "to", "start",
                                "s", "time", "to", "recover", "s", "ckpt", "save", "s",
                                "unsaved", "training", "s", "failures", "causes"]
    row = next(line.split() for line in table if line.startswith("cli-job"))
    # the report's words, in tenths of a second: time to start, time to recover,
    # checkpoint save time, unsaved training time; the failure's cause (no end: lost)
    assert row == ["cli-job", "llm", "81.0", "1000.0", "30.0", "46.0", "14.0", "100.0", "1",
                   "lost:1"]
    attempts = megacache("jobs", "cli-job").splitlines()
    # no compile reported: attempt 1's 10 s of compile count as recovery here
    assert attempts[2].split() == ["0", "65.8", "266.0", "0", "30.0", "0", "8.0", "0",
                                   "100.0", "0", "0", "30.0", "-", "failed:lost"]
    assert attempts[3].split()[-3:] == ["-", "46.0", "finished"]
    assert attempts[4].split()[:3] == ["TOTAL", "81.0", "810.0"]
    assert attempts[4].split()[-2:] == ["1", "failed"]  # the failures under "state"
    assert attempts[8].split()[:3] == ["0", "lost", "no"]  # the failure's cause, and why
    assert json.loads(megacache("jobs", "cli-job", "--json"))["ett_pct"] == 81.0
    missing = subprocess.run([sys.executable, "-m", "megacache_client.cli", "jobs", "nope"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode != 0 and "404" in missing.stderr
