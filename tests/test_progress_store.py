"""The ProgressStore contract, run against every index backend (SQLite and Redis): batches
fold into one bounded summary per attempt, a flood stays bounded, namespaces never mix."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from helpers import run

from megacache_client.wire.progress import ProgressRecord
from megacache_server.store.index import progress
from megacache_server.store.index.base import Index

T0 = 1_800_000_000.0
def beat(at: float, step: int) -> ProgressRecord:
    return ProgressRecord(kind="heartbeat", at=at, step=step)


def save(at: float, step: int, blocking: float, background: float = 0.0) -> ProgressRecord:
    return ProgressRecord(kind="checkpoint_save", at=at, step=step, blocking_s=blocking,
                          background_s=background)


def test_batches_fold_into_one_summary_per_attempt(make_index: Callable[[], Index]) -> None:
    async def body(index: Index) -> None:
        assert await index.job_progress("a", "j1") is None
        await index.add_progress("a", "j1", 0, "llm", [
            ProgressRecord(kind="start", at=T0 + 5, allocation_start=T0),
            ProgressRecord(kind="training", at=T0 + 20), beat(T0 + 30, 10)], T0 + 31)
        await index.add_progress("a", "j1", 0, None, [
            beat(T0 + 40, 20), save(T0 + 41, 20, 2.0), beat(T0 + 50, 30)], T0 + 51)
        again = [save(T0 + 41, 20, 2.0), beat(T0 + 50, 30)]  # a retried batch: no change
        await index.add_progress("a", "j1", 0, None, again, T0 + 52)
        await index.add_progress("a", "j1", 1, None, [
            ProgressRecord(kind="start", at=T0 + 70),
            ProgressRecord(kind="checkpoint_load", at=T0 + 75, blocking_s=3.0, step=20),
            ProgressRecord(kind="end", at=T0 + 90, reason="finished")], T0 + 91)
        job = await index.job_progress("a", "j1")
        assert job is not None and job.model == "llm" and job.last_seen == T0 + 91
        first, second = job.attempts
        assert (first.attempt, second.attempt) == (0, 1)
        assert first.allocation_start == T0 and first.start_at == T0 + 5
        assert first.training_at == T0 + 20
        assert first.first_heartbeat == (T0 + 30, 10)
        assert first.last_heartbeat == (T0 + 50, 30)
        assert first.saves == (progress.Save(T0 + 41, 20, 2.0, 0.0),)
        assert first.saves_n == 1 and first.saves_blocking_s == 2.0
        assert (first.first_at, first.last_at) == (T0 + 5, T0 + 50)
        assert second.loads == (progress.Load(T0 + 75, 3.0, 20),)
        assert (second.end_at, second.end_reason) == (T0 + 90, "finished")
        # another namespace's job of the same id is another job
        assert await index.job_progress("b", "j1") is None
        await index.add_progress("b", "j1", 0, "secret", [beat(T0 + 1, 1)], T0 + 2)
        mine = await index.recent_progress(namespace="a", since=0, limit=10)
        assert [(j.namespace, j.job) for j in mine] == [("a", "j1")]
        assert mine[0].attempts == job.attempts
        every = await index.recent_progress(namespace=None, since=0, limit=10)
        assert [(j.namespace, j.job) for j in every] == [("a", "j1"), ("b", "j1")]
        assert await index.recent_progress(namespace="a", since=T0 + 92, limit=10) == []

    run(make_index, body)


def test_a_flood_stays_bounded(make_index: Callable[[], Index]) -> None:
    async def body(index: Index) -> None:
        n = progress.MAX_SAVES * 3
        for i in range(0, n, 16):
            await index.add_progress("a", "j", 0, None,
                                     [save(T0 + 10 * k, k, 1.0 + k) for k in range(i, i + 16)]
                                     + [beat(T0 + 10 * k + 5, k) for k in range(i, i + 16)],
                                     T0 + 10 * i)
        job = await index.job_progress("a", "j")
        assert job is not None
        (a,) = job.attempts
        assert len(a.saves) == progress.MAX_SAVES and a.saves_n == n
        assert [s.step for s in a.saves] == list(range(n - progress.MAX_SAVES, n))
        assert a.saves_blocking_s == sum(1.0 + k for k in range(n))
        assert sum(a.save_buckets) == n and a.first_save_at == T0
        assert a.last_heartbeat == (T0 + 10 * (n - 1) + 5, n - 1) and a.records == 2 * n
        # attempts: the newest MAX_ATTEMPTS stay, an older one arriving late is not kept
        for attempt in range(progress.MAX_ATTEMPTS + 5):
            await index.add_progress("a", "k", attempt, None, [beat(T0 + attempt, 1)], T0)
        await index.add_progress("a", "k", 0, None, [beat(T0, 1)], T0)
        job = await index.job_progress("a", "k")
        assert job is not None
        assert [x.attempt for x in job.attempts] == list(range(5, progress.MAX_ATTEMPTS + 5))

    run(make_index, body)


def test_jobs_per_namespace_are_capped_and_pruned(make_index: Callable[[], Index],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("megacache_server.store.index.sqlite.progress.MAX_JOBS", 3)
    monkeypatch.setattr("megacache_server.store.index.progress.MAX_JOBS", 3)  # Redis reads it there

    async def body(index: Index) -> None:
        for i in range(5):
            await index.add_progress("a", f"j{i}", 0, None, [beat(T0 + i, 1)], T0 + i)
        await index.add_progress("b", "other", 0, None, [beat(T0, 1)], T0)
        kept = await index.recent_progress(namespace="a", since=0, limit=10)
        assert [j.job for j in kept] == ["j4", "j3", "j2"]
        assert await index.job_progress("a", "j0") is None
        assert await index.prune_progress(T0 + 3.5) == 3  # j2, j3 and b's job
        assert [j.job for j in await index.recent_progress(namespace=None, since=0,
                                                           limit=10)] == ["j4"]

    run(make_index, body)


def test_a_namespace_over_its_progress_budget_loses_its_longest_silent_jobs(
        make_index: Callable[[], Index]) -> None:
    """#47 item 5: a namespace keeps at most its budget of attempts; past it its longest
    silent jobs go whole (live jobs keep everything), and another namespace is untouched."""
    budget = 100

    async def body(index: Index) -> None:
        await index.add_progress("b", "calm", 0, "m", [beat(T0, 1)], T0,
                                 namespace_attempts=budget)
        for i in range(40):  # 40 jobs x 5 attempts: twice the budget
            for attempt in range(5):
                await index.add_progress("a", f"j{i:02}", attempt, None,
                                         [beat(T0 + i, 1)], T0 + i + attempt / 10,
                                         namespace_attempts=budget)
        kept = await index.recent_progress(namespace="a", since=0, limit=1000)
        assert sum(len(j.attempts) for j in kept) <= budget
        assert [j.job for j in kept] == [f"j{i:02}" for i in range(39, 39 - len(kept), -1)]
        assert len(kept) >= budget // 5 - 1  # what goes is whole jobs, no more than needed
        assert all(len(j.attempts) == 5 for j in kept)
        assert await index.job_progress("a", "j00") is None
        calm = await index.job_progress("b", "calm")
        assert calm is not None and len(calm.attempts) == 1
        # pruning keeps the count right: after it, the budget again admits as many
        assert await index.prune_progress(T0 + 1000) == len(kept) + 1
        for attempt in range(budget):
            await index.add_progress("a", "big", attempt % 64, None, [beat(T0, 1)], T0 + 2000,
                                     namespace_attempts=budget)
        for i in range(36):
            await index.add_progress("a", f"k{i}", 0, None, [beat(T0, 1)], T0 + 2001 + i,
                                     namespace_attempts=budget)
        assert await index.job_progress("a", "big") is not None
        assert len((await index.job_progress("a", "big")).attempts) == 64

    run(make_index, body)


def test_progress_kept_before_the_budget_counts_against_it(
        make_index: Callable[[], Index]) -> None:
    """Attempts a server from before the budget stored (Redis kept no count of them) count
    once the budget applies: the namespace is brought within it at its next new attempt."""
    async def body(index: Index) -> None:
        for i in range(30):
            for attempt in range(3):
                await index.add_progress("a", f"j{i:02}", attempt, None, [beat(T0, 1)], T0 + i)
        redis = getattr(index, "r", None)
        if redis is not None:  # as an older server left it: no count
            await redis.delete(index.keys.progress_attempts(),  # type: ignore[attr-defined]
                               index.keys.progress_counted())  # type: ignore[attr-defined]
        await index.add_progress("a", "new", 0, None, [beat(T0, 1)], T0 + 100,
                                 namespace_attempts=64)
        kept = await index.recent_progress(namespace="a", since=0, limit=1000)
        assert sum(len(j.attempts) for j in kept) <= 64
        assert kept[0].job == "new"

    run(make_index, body)


def test_concurrent_batches_of_one_attempt_lose_nothing(
        make_index: Callable[[], Index]) -> None:
    async def body(index: Index) -> None:
        other = make_index()
        await other.open()
        try:
            await asyncio.gather(*[
                (index if k % 2 else other).add_progress(
                    "a", "j", 0, None, [save(T0 + k, k, 1.0)], T0 + k) for k in range(20)])
        finally:
            await other.close()
        job = await index.job_progress("a", "j")
        assert job is not None and job.attempts[0].saves_n == 20

    run(make_index, body)


def test_many_folds_in_one_write_and_summaries_read_by_stamp(
        make_index: Callable[[], Index]) -> None:
    """`add_progress_many` (what a server's coalesced heartbeats are written with): folds of
    several jobs, namespaces and attempts at once, racing another process's folds of the
    same attempts, end as if each were added alone; `recent_progress_stamps` and
    `jobs_progress` give what `recent_progress` does, and a job's last_seen moves with
    every write (what a reader's remembered summaries are checked by)."""
    async def body(index: Index) -> None:
        other = make_index()
        await other.open()
        try:
            folds = [progress.Fold(ns, f"j{k}", a, None, [beat(T0 + k, k), beat(T0 + 50, 1)],
                                   T0 + 100 + k, 7)
                     for ns in ("a", "b") for k in range(5) for a in (0, 1)]
            await asyncio.gather(index.add_progress_many(folds), *[
                other.add_progress(ns, f"j{k}", 0, None, [save(T0 + 10 + k, k, 1.0)],
                                   T0 + 100 + k) for ns in ("a", "b") for k in range(5)])
        finally:
            await other.close()
        for ns in ("a", "b"):
            for k in range(5):
                job = await index.job_progress(ns, f"j{k}")
                assert job is not None and [a.attempt for a in job.attempts] == [0, 1]
                first, second = job.attempts
                assert first.saves_n == 1 and first.records == 8 and second.records == 7
                assert first.last_heartbeat == (T0 + 50, 1)
                assert first.first_heartbeat == (T0 + k, k)
        stamps = await index.recent_progress_stamps(namespace="a", since=0, limit=3)
        assert [job for _, job, _ in stamps] == ["j4", "j3", "j2"]
        assert await index.jobs_progress(stamps) == await index.recent_progress(
            namespace="a", since=0, limit=3)
        before = dict(((ns, j), seen) for ns, j, seen in await index.recent_progress_stamps(
            namespace=None, since=0, limit=100))
        assert len(before) == 10
        shares = await index.recent_progress_stamps(namespace=None, since=0, limit=2,
                                                    per_namespace=True)  # #58: a share each
        assert sorted((ns, j) for ns, j, _ in shares) == [
            ("a", "j3"), ("a", "j4"), ("b", "j3"), ("b", "j4")], shares
        await index.add_progress_many([progress.Fold("b", "j0", 0, None, [beat(T0 + 60, 2)],
                                                     T0 + 200, 1)])
        after = await index.recent_progress_stamps(namespace=None, since=0, limit=100)
        assert after[0] == ("b", "j0", T0 + 200) and before[("b", "j0")] != T0 + 200

    run(make_index, body)


def test_attempt_stamps_move_only_with_their_attempt(
        make_index: Callable[[], Index]) -> None:
    """`attempt_stamps` sums up a job's attempts in a few numbers: a heartbeat of the last
    attempt moves its `last_stamp` and leaves the `prefix` alone; a write of an older
    attempt, or a new attempt, moves the prefix. `attempts_progress` reads just the
    attempts asked for: what lets a reader re-read one attempt of a heartbeating job, not
    its history. Attempts a job no longer keeps, and jobs pruned, are gone from both."""
    async def body(index: Index) -> None:
        for a in range(3):
            await index.add_progress("a", "j", a, None, [beat(T0 + 10 * a, a)], T0 + 10 * a + 1)
        await index.add_progress("b", "j", 0, None, [beat(T0, 0)], T0 + 1)
        first = await index.attempt_stamps([("a", "j"), ("b", "j"), ("a", "none")])
        assert set(first) == {("a", "j"), ("b", "j")}
        us = progress.stamp_us
        assert first[("a", "j")] == progress.JobStamps(3, 2, us(T0 + 21),
                                                       us(T0 + 1) + us(T0 + 11))
        await index.add_progress("a", "j", 2, None, [beat(T0 + 30, 9)], T0 + 31)
        beat_ = (await index.attempt_stamps([("a", "j")]))[("a", "j")]
        assert beat_.prefix == first[("a", "j")].prefix and beat_.last_stamp == us(T0 + 31)
        await index.add_progress("a", "j", 0, None, [beat(T0 + 3, 1)], T0 + 32)  # late
        late = (await index.attempt_stamps([("a", "j")]))[("a", "j")]
        assert late.prefix != beat_.prefix and late.last_stamp == beat_.last_stamp
        got = await index.attempts_progress([("a", "j", 2), ("a", "j", 0), ("a", "j", 7)])
        assert set(got) == {("a", "j", 2), ("a", "j", 0)}
        assert got[("a", "j", 2)].last_heartbeat == (T0 + 30, 9)
        whole = await index.job_progress("a", "j")
        assert whole is not None and got[("a", "j", 0)] == whole.attempts[0]
        for a in range(3, 3 + progress.MAX_ATTEMPTS):  # the oldest attempts go
            await index.add_progress("a", "j", a, None, [beat(T0 + 10 * a, a)], T0 + 10 * a)
        kept = (await index.attempt_stamps([("a", "j")]))[("a", "j")]
        assert (kept.attempts, kept.last) == (progress.MAX_ATTEMPTS, 2 + progress.MAX_ATTEMPTS)
        assert await index.attempts_progress([("a", "j", 0)]) == {}
        await index.prune_progress(T0 + 5)  # b/j went silent before it
        assert await index.attempt_stamps([("b", "j")]) == {}

    run(make_index, body)


def test_many_folds_racing_for_ever_go_one_at_a_time(
        make_index: Callable[[], Index], monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis: a many-fold write that keeps losing its WATCH race (here: no tries at all)
    folds each one alone, to the same summaries."""
    from megacache_server.store.index.redis import progress as redis_progress

    monkeypatch.setattr(redis_progress, "WATCH_TRIES", 0)

    async def body(index: Index) -> None:
        await index.add_progress_many([
            progress.Fold("a", f"j{k}", a, "m", [beat(T0 + k, k), save(T0 + 1, 1, 2.0)],
                          T0 + 10, 2) for k in range(3) for a in (0, 1)])
        for k in range(3):
            job = await index.job_progress("a", f"j{k}")
            assert job is not None and len(job.attempts) == 2
            assert all(a.saves_n == 1 and a.last_heartbeat == (T0 + k, k) and a.records == 2
                       for a in job.attempts)

    run(make_index, body)


def test_job_view_is_one_job_of_the_events(make_index: Callable[[], Index]) -> None:
    from megacache_client.wire.events import Event
    from megacache_client.wire.schema import parse

    async def body(index: Index) -> None:
        assert await index.job_view("a", "j") is None
        for attempt, compile_s in ((0, 30.0), (1, 5.0)):
            await index.add_event("a", parse(Event, {
                "key": "b" * 64, "model": "llm", "outcome": "miss", "compile_s": compile_s,
                "job_id": "j", "attempt": attempt, "rank": 0, "world_size": 1}))
        await index.add_event("b", parse(Event, {
            "key": "b" * 64, "model": "x", "outcome": "hit", "compile_s": 1.0,
            "job_id": "j", "attempt": 0, "rank": 0, "world_size": 1}))
        view = await index.job_view("a", "j")
        assert view is not None and (view.namespace, view.job_id) == ("a", "j")
        assert {a.attempt: a.compile_s for a in view.attempts} == {0: 30.0, 1: 5.0}
        other = await index.job_view("b", "j")
        assert other is not None and [a.model for a in other.attempts] == ["x"]

    run(make_index, body)
