"""The split of a job's wall time (`service.ett.split`), on hand-made timelines whose answers are
worked out by hand here: every category, failures, lost progress, recovery, and a lying
trainer that cannot push ETT past 100% or any category below zero."""

from __future__ import annotations

import random

import pytest

from megacache_client.wire.progress import ProgressRecord
from megacache_server.service.ett import report as ett_report
from megacache_server.service.ett import split as ett
from megacache_server.store.index.progress import MAX_SAVES, JobProgress, merge

T0 = 1_800_000_000.0


def rec(kind: str, at: float, **fields: object) -> ProgressRecord:
    return ProgressRecord(kind=kind, at=T0 + at, **fields)  # type: ignore[arg-type]


def job(*attempts: list[ProgressRecord], model: str = "llm") -> JobProgress:
    summaries = tuple(merge(None, n, model, records, T0 + max(r.at for r in records) - T0)
                      for n, records in enumerate(attempts))
    return JobProgress("ns", "j", T0, summaries)


def approx(seconds: dict[str, float], **want: float) -> None:
    expected = dict.fromkeys(ett.CATEGORIES, 0.0) | want
    assert seconds == pytest.approx(expected, abs=1e-6)


def test_one_finished_attempt() -> None:
    # allocated at 0, process at 10, compile 20 s before the first step at 40, two saves
    # of 5 s blocking (the second also 10 s in the background), finished at 1000
    one = job([rec("start", 10, allocation_start=T0), rec("training", 40),
               rec("checkpoint_save", 200, step=100, blocking_s=5.0),
               rec("heartbeat", 300, step=150),
               rec("checkpoint_save", 500, step=300, blocking_s=5.0, background_s=10.0),
               rec("end", 1000, reason="finished")])
    got = ett.split(one, compile_s={0: 20.0})
    # startup 0-20, compile 20-40, training 40-1000 less 10 s of saves
    approx(got.seconds, startup=20, compile=20, training=950, checkpoint_save=10)
    row = got.row()
    assert row["wall_s"] == 1000 and row["ett_pct"] == 95.0 and row["failures"] == 0
    (a,) = row["attempts"]
    assert a["time_to_start_s"] == 40 and a["failed"] is False and a["lost_s"] is None
    assert a["checkpoint_saves"] == 2 and a["checkpoint_blocking_s"] == 10


def test_a_killed_attempt_then_a_recovery() -> None:
    first = [rec("start", 0), rec("training", 30),
             rec("checkpoint_save", 100, step=70, blocking_s=4.0),  # durable at 104
             rec("heartbeat", 250, step=200)]  # killed: its last fact
    second = [rec("start", 400), rec("checkpoint_load", 410, blocking_s=20.0, step=70),
              rec("training", 450), rec("checkpoint_save", 700, step=500, blocking_s=6.0),
              rec("end", 1000, reason="finished")]
    got = ett.split(job(first, second), compile_s={1: 10.0})
    # attempt 0: startup 0-30, training 30-100, lost 100-250 less the save's 4 s
    # attempt 1: recovery 250-450 less restore 410-430 and compile 440-450; training
    # 450-1000 less its save
    approx(got.seconds, startup=30, training=70 + 544, checkpoint_save=4 + 6,
           lost_progress=146, checkpoint_restore=20, compile=10, recovery=170)
    row = got.row()
    assert row["wall_s"] == 1000 and row["ett_pct"] == 61.4
    assert row["failures"] == 1 and row["lost_s_per_failure"] == [146]
    assert (row["time_to_start_s"], row["time_to_recover_s"], row["recoveries"],
            row["checkpoint_save_s"], row["unsaved_training_s"]) == (30, 200, 1, 10, 146)
    a0, a1 = row["attempts"]
    assert (a0["start"], a0["end"], a1["start"], a1["end"]) == (T0, T0 + 250, T0 + 250,
                                                                T0 + 1000)
    assert a0["failed"] and not a1["failed"] and a0["time_to_start_s"] == 30
    assert a1["time_to_recover_s"] == 200 and a1["time_to_start_s"] is None
    assert a0["seconds"]["lost_progress"] == 146 and a1["seconds"]["training"] == 544


def test_a_save_s_completion_is_a_sign_of_life() -> None:
    """The issue's killed timeline (#46): start t0, first step t0+10, heartbeats t0+35 and
    t0+65, saves at t0+40 (1 s) and t0+70 (1 s blocking + 2 s in the background), no more
    records. A save's record goes out once the save is durable, so the attempt lived until
    t0+73: its failure is no earlier, the second save counts as durable, and its blocking
    is kept. (Dated at the last heartbeat, as before: 29 s lost and 1 s of blocking.)"""
    first = [rec("start", 0), rec("training", 10), rec("heartbeat", 35, step=20),
             rec("checkpoint_save", 40, step=25, blocking_s=1.0),
             rec("heartbeat", 65, step=50),
             rec("checkpoint_save", 70, step=55, blocking_s=1.0, background_s=2.0)]
    second = [rec("start", 90), rec("training", 100), rec("end", 110, reason="finished")]
    got = ett.split(job(first, second))
    a0 = got.row()["attempts"][0]
    assert a0["end"] == T0 + 73 and a0["failed"]
    assert a0["lost_s"] == 2.0 and a0["checkpoint_blocking_s"] == 2.0, a0
    approx(got.seconds, startup=10, training=59 + 10, checkpoint_save=2, lost_progress=2,
           recovery=27)


def test_a_clean_failure_with_no_checkpoint_loses_all_its_training() -> None:
    got = ett.split(job([rec("start", 0), rec("training", 10), rec("heartbeat", 50, step=5),
                         rec("end", 60, reason="failed")]))
    approx(got.seconds, startup=10, lost_progress=50)
    assert got.row()["ett_pct"] == 0.0 and got.row()["failures"] == 1


def test_a_live_attempt_has_not_failed() -> None:
    records = [rec("start", 0), rec("training", 10), rec("heartbeat", 100, step=9)]
    got = ett.split(job(records), now=T0 + 130)
    approx(got.seconds, startup=10, training=90)
    assert got.live and got.row()["failures"] == 0
    assert not ett.split(job(records), now=T0 + 100 + ett.LIVE_S + 1).live


def test_saves_too_old_to_keep_one_by_one_still_count() -> None:
    n = MAX_SAVES + 20
    records = [rec("start", 0), rec("training", 10)]
    records += [rec("checkpoint_save", 100 + 10 * k, step=k, blocking_s=1.0) for k in range(n)]
    records.append(rec("end", 100 + 10 * n, reason="finished"))
    got = ett.split(job(records))
    wall = 100 + 10 * n
    approx(got.seconds, startup=10, checkpoint_save=n, training=wall - 10 - n)
    a = got.attempts[0]
    assert a.saves == n and a.save_interval == (10.0 * (n - 1), n - 1)


def test_gaps_nobody_reported_are_idle_and_the_attempt_never_trained() -> None:
    # attempt 0 never reached a step and failed; attempt 1 started 100 s later
    got = ett.split(job([rec("start", 0), rec("heartbeat", 40, step=0)],
                        [rec("start", 140), rec("training", 150),
                         rec("end", 200, reason="finished")]))
    approx(got.seconds, startup=40, recovery=110, training=50)
    assert got.row()["lost_s_per_failure"] == [0]


def test_a_lying_trainer_cannot_pass_100_percent_nor_go_negative() -> None:
    rng = random.Random(41)
    kinds = ("start", "training", "heartbeat", "checkpoint_save", "checkpoint_load", "end")
    for _ in range(300):
        attempts = []
        for _ in range(rng.randint(1, 4)):
            records = []
            for _ in range(rng.randint(1, 12)):
                kind = rng.choice(kinds)
                at = rng.uniform(0, 5000)
                fields: dict[str, object] = {}
                if kind in ("heartbeat", "checkpoint_save"):
                    fields["step"] = rng.randint(0, 10**6)
                if kind in ("checkpoint_save", "checkpoint_load"):
                    fields["blocking_s"] = rng.choice([0.0, 1.0, 600.0, 7 * 24 * 3600.0])
                    fields["background_s"] = rng.choice([None, 0.0, 3600.0])
                if kind == "start" and rng.random() < 0.5:
                    fields["allocation_start"] = T0 + at - rng.uniform(0, 10**6)
                if kind == "end":
                    fields["reason"] = rng.choice(["finished", "failed"])
                records.append(rec(kind, at, **fields))
            attempts.append(records)
        compile_s = {n: rng.choice([0.0, 50.0, 10**6]) for n in range(len(attempts))}
        got = ett.split(job(*attempts), compile_s=compile_s, now=T0 + 6000)
        row = got.row()
        seconds = got.seconds
        assert all(v >= -1e-9 for v in seconds.values()), seconds
        wall = row["end"] - row["start"]
        assert sum(seconds.values()) == pytest.approx(wall, abs=1e-6)
        assert row["ett_pct"] is None or 0 <= row["ett_pct"] <= 100
        for a in got.attempts:
            assert all(v >= -1e-9 for v in a.seconds.values())
            assert sum(a.seconds.values()) == pytest.approx(a.wall_s, abs=1e-6)


def test_windows_clip_segments() -> None:
    got = ett.split(job([rec("start", 0), rec("training", 100),
                         rec("end", 1000, reason="finished")]))
    approx(ett.clip(got.segments, T0 + 50, T0 + 150), startup=50, training=50)
    approx(ett.clip(got.segments, T0 + 2000, T0 + 3000))


def killed_then_recovered() -> JobProgress:
    return job([rec("start", 0), rec("training", 30),
                rec("checkpoint_save", 100, step=70, blocking_s=4.0),
                rec("checkpoint_save", 300, step=250, blocking_s=4.0, background_s=100.0),
                rec("heartbeat", 350, step=300)],
               [rec("start", 400), rec("checkpoint_load", 410, blocking_s=20.0, step=70),
                rec("training", 450), rec("checkpoint_save", 700, step=500, blocking_s=6.0),
                rec("end", 1000, reason="finished")])


def test_checkpoint_advice_by_hand() -> None:
    got = ett_report.advice([ett.split(killed_then_recovered())])
    assert got is not None
    # b: 14 s of blocking over 3 saves; λ: 1 failure over 810 + 100 + 14 s of running
    # (attempt 0 lived until its second save was durable, at 404); T: attempt 0 saved at
    # 100 and 300 (attempt 1 once: no interval)
    b, rate, interval = 14 / 3, 1 / 924, 200.0
    best = (2 * b / rate) ** 0.5  # √(2 · 4.667 · 924) = 92.9 s
    gain = ((b / interval + rate * interval / 2) - (b / best + rate * best / 2)) * 100
    assert gain == pytest.approx(3.105, abs=0.01)
    assert got == {"blocking_per_save_s": 4.667, "saves": 3, "failures": 1, "run_s": 924.0,
                   "failures_per_hour": round(3600 / 924, 6), "interval_s": 200.0,
                   "best_interval_s": round(best, 3), "ett_gain_pct": round(gain, 3),
                   "confidence": "low"}


def test_no_failure_or_no_save_no_advice() -> None:
    finished = job([rec("start", 0), rec("training", 10),
                    rec("checkpoint_save", 50, step=5, blocking_s=2.0),
                    rec("end", 100, reason="finished")])
    assert ett_report.advice([ett.split(finished)]) is None
    unsaved = job([rec("start", 0), rec("training", 10), rec("end", 100, reason="failed")])
    assert ett_report.advice([ett.split(unsaved)]) is None
    # the advice row says why there is none (#46: "no failure seen yet" stood beside a
    # failure count of 1)
    assert ett_report.no_advice_why([ett.split(finished)]).startswith("no failure seen yet")
    assert ett_report.no_advice_why([ett.split(unsaved)]).startswith(
        "1 failure but no checkpoint save seen")


def test_a_window_per_model_and_namespace() -> None:
    a = ett.split(killed_then_recovered())
    other = JobProgress("ns2", "k", T0, (merge(None, 0, "vit", [
        rec("start", 0), rec("training", 500), rec("end", 1000, reason="finished")], T0),))
    b = ett.split(other)
    got = ett_report.window([a, b], T0 + 0, T0 + 500)
    # job a's first 500 s: startup 0-30, training 30-300 (less save 1's 4 s), lost 300-404
    # (its second save was durable at 404: the attempt lived until then; less the save's
    # 4 s), recovery 404-450 less restore 410-430 (no compile known), training 450-500;
    # job b's: startup 0-500
    assert got["wall_s"] == 1000 and got["ett_pct"] == 31.6
    assert got["seconds"]["startup"] == 530 and got["seconds"]["recovery"] == 26
    assert got["seconds"]["lost_progress"] == 100 and got["seconds"]["checkpoint_save"] == 8
    assert (got["unsaved_training_s"], got["checkpoint_save_s"]) == (100, 8)
    # time to start per job (a: 30 s, b: 500 s), to recover per recovery (a: 46 s): the
    # values themselves, nearest rank
    assert got["time_to_start"] == {"n": 2, "p50_s": 30.0, "p90_s": 500.0}
    assert got["time_to_recover"] == {"n": 1, "p50_s": 46.0, "p90_s": 46.0}
    models = {m["model"]: m for m in got["models"]}
    assert models["llm"]["ett_pct"] == 63.2 and models["vit"]["ett_pct"] == 0.0
    assert models["llm"]["advice"]["failures"] == 1 and models["vit"]["advice"] is None
    assert models["llm"]["advice_why"] is None
    assert models["vit"]["advice_why"] == "no failure and no checkpoint save seen yet"
    assert [n["namespace"] for n in got["namespaces"]] == ["ns", "ns2"]


def test_data_wait_is_taken_from_training_up_to_the_heartbeat_that_said_it() -> None:
    """The loop's wait for batches (#50) comes as a sum with the heartbeats, not as
    intervals: it is taken from the training before the heartbeat that said it."""
    one = job([rec("start", 0), rec("training", 10),
               rec("heartbeat", 60, step=50, data_wait_s=5.0),
               rec("heartbeat", 100, step=90, data_wait_s=8.0),
               rec("end", 100, reason="finished")])
    got = ett.split(one)
    approx(got.seconds, startup=10, training=82, data_wait=8)
    assert got.row()["ett_pct"] == 82.0
    # killed after a save: the data waited in the training the failure threw away stays
    # lost; what was said before the save comes out of training before it
    killed = job([rec("start", 0), rec("training", 10),
                  rec("heartbeat", 40, step=30, data_wait_s=3.0),
                  rec("checkpoint_save", 50, step=40, blocking_s=2.0),
                  rec("heartbeat", 70, step=60, data_wait_s=6.0)],
                 [rec("start", 80), rec("training", 90), rec("end", 100, reason="finished")])
    got = ett.split(killed)
    # the 6 s are spread over the loop's 58 s from 10 to 70 (training 10-50, lost 52-70):
    # training's share, 40 x 6/58 s, is data wait; the lost training's stays lost
    approx(got.seconds, startup=10, training=40 - 240 / 58 + 10, data_wait=240 / 58,
           checkpoint_save=2, lost_progress=18, recovery=20)


def test_a_job_split_from_its_kept_prefix_equals_one_painting_of_every_attempt() -> None:
    """`ett.split` (the attempts before the last split once, `ett.prefix`, and kept; the
    last split alone, `ett.join`: what a reader does while a job heartbeats) gives exactly
    what one painting of every attempt gives, for restarts that follow their failures;
    one that reaches back into its predecessors' time is painted from where they ended,
    and the wall time still adds up."""
    rng = random.Random(47)
    kinds = ("training", "heartbeat", "checkpoint_save", "checkpoint_load", "end")
    followed = 0
    for _ in range(400):
        attempts, at = [], 0.0
        for _ in range(rng.randint(2, 6)):
            at += rng.choice([5.0, 60.0, -30.0 if rng.random() < 0.2 else 10.0])
            records = [rec("start", at, **({"allocation_start": T0 + at - 50}
                                           if not attempts else {}))]
            for _ in range(rng.randint(1, 8)):
                at += rng.uniform(0, 40)
                kind = rng.choice(kinds)
                fields: dict[str, object] = {}
                if kind in ("heartbeat", "checkpoint_save"):
                    fields["step"] = rng.randint(0, 1000)
                if kind in ("checkpoint_save", "checkpoint_load"):
                    fields["blocking_s"] = rng.choice([0.0, 2.0, 30.0])
                    fields["background_s"] = rng.choice([None, 5.0])
                if kind == "heartbeat" and rng.random() < 0.3:
                    fields["data_wait_s"] = rng.uniform(0, 20)
                if kind == "end":
                    fields["reason"] = rng.choice(["finished", "failed"])
                records.append(rec(kind, at, **fields))
            attempts.append(records)
        whole = job(*attempts)
        compile_s = {n: rng.choice([0.0, 7.0]) for n in range(len(attempts))}
        now = T0 + at + rng.choice([1.0, 10**4])
        got = ett.split(whole, compile_s=compile_s, now=now)
        row = got.row()
        assert sum(got.seconds.values()) == pytest.approx(row["end"] - row["start"])
        assert all(v >= -1e-9 for v in got.seconds.values())
        ends = [a.last_at for a in whole.attempts[:-1]]
        if whole.attempts[-1].first_at < max(ends) or ends[-1] < max(ends):
            continue  # reaches back: not the one painting's answer, by design
        followed += 1
        once = ett._run(list(whole.attempts), compile_s, now, last_failed=None)
        want = ett.JobSplit("ns", "j", "llm", T0, once.splits, once.segments)
        assert row == want.row()
        assert len(got.segments) == len(want.segments)
        for (s1, e1, c1), (s2, e2, c2) in zip(got.segments, want.segments, strict=True):
            assert c1 == c2 and s1 == pytest.approx(s2) and e1 == pytest.approx(e2)
    assert 100 < followed < 400  # both kinds of restart were drawn


@pytest.mark.parametrize(("first", "cause"), [
    # it said why: that stands, whatever the restart found on the node
    ([rec("end", 50, reason="failed", cause="preempted", detail="SIGTERM"),
      rec("failure", 50, cause="killed", detail="x")], "preempted"),
    # it said nothing: the restart's word
    ([rec("failure", 50, cause="killed", detail="SIGSEGV")], "killed"),
    # nothing from it, nothing from its node
    ([], "lost"),
    # failed, without a cause (an older client)
    ([rec("end", 50, reason="failed")], "unknown"),
    # said it finished, and the job ran again
    ([rec("end", 50, reason="finished")], "unknown"),
])
def test_the_cause_of_a_failure_is_its_own_word_else_the_restart_s_else_lost(
        first: list[ProgressRecord], cause: str) -> None:
    done = ett.split(job([rec("start", 0), rec("training", 10), rec("heartbeat", 50, step=4),
                          *first],
                         [rec("start", 60), rec("training", 70),
                          rec("end", 90, reason="finished")]), now=T0 + 100)
    a0, a1 = done.attempts
    assert (a0.failed, a0.cause, a1.cause) == (True, cause, None)
    assert done.totals.by_cause == {cause: (1, 40.0, 20.0)}  # 10-50 lost, 50-70 recovering
