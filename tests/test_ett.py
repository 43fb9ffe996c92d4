"""Effective Training Time on a real server, on every backend pair: job attempts reported by
many ranks count once, `/metrics` exports them as histograms Prometheus can take quantiles
of, `/v1/stats`, `/v1/jobs` and `/v1/dashboard` show them, and one tenant never sees
another's jobs."""

from __future__ import annotations

import math

import httpx
import pytest
from helpers import ServerProcess, token_client
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = ("megacache_run_first_step_seconds", "megacache_rerun_first_step_seconds",
              "megacache_job_compile_seconds")


def event(model: str, **fields: object) -> dict[str, object]:
    return {"key": "b" * 64, "model": model, "outcome": "miss", "compile_s": 3.0, **fields}


def post_job(c: httpx.Client, model: str, job: str, attempt: int, times: list[float]) -> None:
    for rank, tts in enumerate(times):
        r = c.post("/v1/events", json=event(model, job_id=job, attempt=attempt, rank=rank,
                                            world_size=len(times), tts_s=tts,
                                            compile_s=tts / 2))
        assert r.status_code == 202, r.text


def histograms(text: str) -> dict[tuple[str, str, str], dict[str, float]]:
    """(family, namespace, model) -> {le or _sum/_count: value}."""
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in HISTOGRAMS:
            continue
        assert family.type == "histogram"
        for s in family.samples:
            key = (family.name, s.labels["namespace"], s.labels["model"])
            part = s.labels["le"] if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]
            out.setdefault(key, {})[part] = s.value
    return out


def test_job_attempts_in_metrics_stats_jobs_and_dashboard(events_server: ServerProcess):
    team_a = token_client(events_server, "read,write", "team-a")
    team_b = token_client(events_server, "read,write", "team-b")
    prometheus = token_client(events_server, "metrics")
    # team A: job j1 starts on 4 ranks (slowest 95 s) and recovers twice; job j2 starts
    # warm; one run without a job; team B: one job with the same id
    post_job(team_a, "llm", "j1", 0, [30.0, 95.0, 40.0, 20.0])
    post_job(team_a, "llm", "j1", 1, [12.0, 14.0, 11.0, 13.0])
    post_job(team_a, "llm", "j1", 2, [8.0, 9.0])
    post_job(team_a, "vit", "j2", 0, [4.0, 6.0])
    assert team_a.post("/v1/events", json=event("vit", tts_s=50.0)).status_code == 202
    post_job(team_b, "secret-model", "j1", 0, [7.0])

    text = prometheus.get("/metrics").text
    found = histograms(text)
    counts: dict[str, float] = dict.fromkeys(HISTOGRAMS, 0.0)
    for (name, _, _), samples in found.items():
        les = sorted((float(le), v) for le, v in samples.items() if le not in ("sum", "count"))
        assert les[-1][0] == math.inf and les[-1][1] == samples["count"]
        assert [v for _, v in les] == sorted(v for _, v in les)  # cumulative: monotone
        counts[name] += samples["count"]
    # every job attempt once: 3 attempts 0 + 1 run of its own are starts, 2 recoveries
    assert counts["megacache_run_first_step_seconds"] == 4
    assert counts["megacache_rerun_first_step_seconds"] == 2
    assert counts["megacache_job_compile_seconds"] == 6  # every attempt: starts + recoveries
    llm = found[("megacache_run_first_step_seconds", "team-a", "llm")]
    assert llm["sum"] == 95.0 and llm["90.0"] == 0 and llm["120.0"] == 1
    ttr = found[("megacache_rerun_first_step_seconds", "team-a", "llm")]
    assert ttr["sum"] == 14.0 + 9.0 and ttr["count"] == 2

    def sample(name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        raise AssertionError(name)

    assert sample("megacache_job_restarts_total", namespace="team-a", model="llm") == 2
    assert sample("megacache_job_attempts_total", namespace="team-a", model="llm") == 3

    # the tenant's own /metrics, stats, jobs and dashboard: its jobs only
    own = histograms(team_b.get("/metrics").text)
    assert {ns for _, ns, _ in own} == {"team-b"}
    stats = team_b.get("/v1/stats").json()
    assert stats["total"]["attempts"] == 1 and stats["total"]["restarts"] == 0
    assert team_b.get("/v1/jobs").json()["jobs"][0]["attempts"][0]["seconds"] == 7.0
    assert len(team_b.get("/v1/jobs").json()["jobs"]) == 1
    dash_b = team_b.get("/v1/dashboard", params={"hours": 24}).json()
    assert [j["namespace"] for j in dash_b["jobs"]] == ["team-b"]
    assert "llm" not in team_b.get("/v1/dashboard").text

    total = team_a.get("/v1/stats").json()["total"]
    assert (total["attempts"], total["restarts"], total["tts_n"], total["ttr_n"]) == \
        (5, 2, 3, 2)
    assert 0 < total["tts_p50_s"] <= total["tts_p90_s"] <= 120
    # the recoveries' slowest ranks, 9 s and 14 s, fall in the buckets (5, 10] and (10, 15]
    assert 5 < total["ttr_p50_s"] <= 10 < total["ttr_p90_s"] <= 15
    models = {m["model"]: m for m in team_a.get("/v1/stats").json()["models"]}
    assert models["llm"]["restarts"] == 2 and models["llm"]["tts_p90_s"] > 90
    assert models["llm"]["compile_per_job_s"] == round((47.5 + 7.0 + 4.5) / 3, 3)
    [j2, j1] = team_a.get("/v1/jobs").json()["jobs"]
    assert (j1["job_id"], j1["restarts"], [a["attempt"] for a in j1["attempts"]]) == \
        ("j1", 2, [2, 1, 0])
    assert [a["seconds"] for a in j1["attempts"]] == [9.0, 14.0, 95.0]
    assert j1["attempts"][2]["reports"] == 4 and j1["attempts"][2]["world_size"] == 4
    assert j1["attempts"][0]["kind"] == "recover" and j1["attempts"][2]["kind"] == "start"
    dash = team_a.get("/v1/dashboard", params={"hours": 24}).json()
    assert {j["job_id"] for j in dash["jobs"]} == {"j1", "j2"}
    assert dash["total"]["tts_p50_s"] == total["tts_p50_s"]


@pytest.mark.parametrize("bad", [
    {"attempt": float("nan")}, {"attempt": 10**12}, {"attempt": -1}, {"rank": "0"},
    {"world_size": 0}, {"job_id": "../etc"}, {"job_id": "x" * 129}, {"job_id": ""},
    {"rank": 5, "world_size": 2}, {"tts_s": 1e300},
])
def test_bad_job_fields_are_refused(events_server: ServerProcess, bad: dict[str, object]):
    with token_client(events_server, "read,write", "team-c") as c:
        good = event("m", job_id="ok-1", attempt=10**6, rank=1, world_size=2, tts_s=1.0)
        assert c.post("/v1/events", json=good).status_code == 202
        body = httpx.Request("POST", "/", json=event("m", **{"job_id": "j", **bad})).content \
            if not any(isinstance(v, float) and math.isnan(v) for v in bad.values()) \
            else ('{"key": "' + "b" * 64 + '", "model": "m", "outcome": "miss", '
                  '"job_id": "j", "attempt": NaN}').encode()
        r = c.post("/v1/events", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert [j["job_id"] for j in c.get("/v1/jobs").json()["jobs"]] == ["ok-1"]


def test_a_follow_up_adds_what_changed_and_counts_no_new_run(events_server: ServerProcess
                                                             ) -> None:
    """A process reports right after its first step, then at exit only what changed since
    (`followup`): compile seconds and bytes add up, the run, its outcome, its miss reason
    and its time to start count once."""
    c = token_client(events_server, "read,write", "team-follow")
    first = event("fu", job_id="fj", attempt=0, rank=0, world_size=1, tts_s=20.0,
                  compile_s=10.0, bytes_down=100, reason="no entry yet")
    later = {"key": "b" * 64, "model": "fu", "outcome": "miss", "followup": True,
             "compile_s": 2.5, "bytes_up": 4000, "published": True, "job_id": "fj",
             "attempt": 0, "rank": 0, "world_size": 1}
    for body in (first, later):
        assert c.post("/v1/events", json=body).status_code == 202
    (model,) = c.get("/v1/stats").json()["models"]
    assert (model["runs"], model["outcomes"]["miss"], model["tts_n"]) == (1, 1, 1), model
    assert (model["compile_s"], model["bytes_down"], model["bytes_up"]) == (12.5, 100, 4000)
    (job,) = c.get("/v1/jobs").json()["jobs"]
    (attempt,) = job["attempts"]
    assert (attempt["seconds"], attempt["reports"], attempt["compile_s"]) == (20.0, 1, 10.0)
    misses = c.get("/v1/dashboard", params={"hours": 24}).json()["top_misses"]
    assert [m["count"] for m in misses] == [1], misses
    # a follow-up claims no time to start, replay or seconds saved
    for bad in ({"tts_s": 3.0}, {"replay": "full"}, {"saved_s": 1.0, "cold_compile_s": 5.0}):
        r = c.post("/v1/events", json={**later, **bad})
        assert r.status_code == 422 and "follow-up" in r.text, (bad, r.text)


def test_the_exit_sends_only_what_changed_since_the_first_step() -> None:
    from megacache_client.steps.report import followups
    from megacache_client.wire.events import Event

    first = Event(key="a" * 64, model="m", outcome="hit", compile_s=1.5, bytes_down=900,
                  fxgraph_hit=2, tts_s=4.0, replay="full", job_id="j", attempt=1)
    other = Event(key="c" * 64, model="m2", outcome="miss")
    same = Event(key="a" * 64, model="m", outcome="hit", compile_s=1.5, bytes_down=900,
                 fxgraph_hit=2, tts_s=4.0, replay="full", job_id="j", attempt=1)
    assert followups([first], [same]) == []  # nothing changed: nothing sent
    later = Event(key="a" * 64, model="m", outcome="hit", compile_s=4.0, bytes_down=900,
                  bytes_up=5000, fxgraph_hit=3, fxgraph_miss=1, tts_s=4.0, replay="partial",
                  published=True, job_id="j", attempt=1)
    (more, new) = followups([first], [later, other])
    assert more.followup and (more.compile_s, more.bytes_up, more.bytes_down) == (2.5, 5000, 0)
    assert (more.fxgraph_hit, more.fxgraph_miss, more.published) == (1, 1, True)
    assert (more.tts_s, more.replay, more.saved_s, more.job_id) == (None, None, 0.0, "j")
    assert new is other and not new.followup  # a track first compiled later: its whole event
