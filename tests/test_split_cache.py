"""Views over many jobs cost what changed, not the history (issue 47, item 2): the split
cache (`service.ett.split_cache`) on every index backend reads an attempt's summary again
only when that attempt was written, gives what a split of the whole job gives, and keeps
a bounded number of attempts."""

from __future__ import annotations

import time
from collections.abc import Callable

from helpers import run

from megacache_client.wire.progress import ProgressRecord
from megacache_server.service.ett import split as ett
from megacache_server.service.ett.split_cache import SplitCache
from megacache_server.store.index.base import Index

T0 = 1_800_000_000.0
JOBS, ATTEMPTS = 12, 6


def attempt_records(a: int) -> list[ProgressRecord]:
    at = T0 + 120 * a
    records = [ProgressRecord(kind="start", at=at), ProgressRecord(kind="training", at=at + 20),
               ProgressRecord(kind="heartbeat", at=at + 60, step=10 * a)]
    if a < ATTEMPTS - 1:
        records.append(ProgressRecord(kind="end", at=at + 100, reason="failed"))
    return records


async def fill(index: Index) -> None:
    for j in range(JOBS):
        for a in range(ATTEMPTS):
            await index.add_progress("t", f"j{j}", a, f"m{j % 3}", attempt_records(a),
                                     T0 + 120 * a + 101 + j)


def compile_s(ns: str, job: str) -> dict[int, float]:
    return {0: 7.0} if job == "j1" else {}


async def read(index: Index, cache: SplitCache) -> tuple[int, list[ett.JobSplit]]:
    """What one read of the namespace's views costs (attempts decoded) and gives; checked
    against a split of each whole job, read afresh."""
    before = cache.read_attempts
    stamps = await index.recent_progress_stamps(namespace="t", since=0, limit=1000)
    got = await cache.splits(stamps, compile_s)
    assert [(s.namespace, s.job, s.last_seen) for s in got] == stamps
    for split in got:
        whole = await index.job_progress("t", split.job)
        assert whole is not None
        want = ett.split(whole, compile_s=compile_s("t", split.job), now=time.time())
        assert split.row() == want.row()
    return cache.read_attempts - before, got


def test_a_read_decodes_only_the_attempts_written_since_the_last(
        make_index: Callable[[], Index]) -> None:
    async def body(index: Index) -> None:
        await fill(index)
        cache = SplitCache(index)
        cost, got = await read(index, cache)
        assert cost == JOBS * ATTEMPTS and len(got) == JOBS  # the first read: everything
        assert (await read(index, cache))[0] == 0  # nothing written: nothing read
        later = T0 + 120 * ATTEMPTS + 500
        for j in (2, 5, 7):  # three jobs heartbeat their last attempt
            await index.add_progress("t", f"j{j}", ATTEMPTS - 1, None, [
                ProgressRecord(kind="heartbeat", at=later, step=10**6)], later + 1)
        assert (await read(index, cache))[0] == 3
        # a late record of an old attempt: that job is read whole, once
        await index.add_progress("t", "j3", 0, None, [
            ProgressRecord(kind="checkpoint_save", at=T0 + 50, step=3, blocking_s=4.0)],
            later + 2)
        assert (await read(index, cache))[0] == ATTEMPTS
        # a new attempt: its job is read whole (its prefix changed)
        await index.add_progress("t", "j4", ATTEMPTS, None, [
            ProgressRecord(kind="start", at=later + 10)], later + 11)
        assert (await read(index, cache))[0] == ATTEMPTS + 1
        assert (await read(index, cache))[0] == 0

    run(make_index, body)


def test_what_the_cache_keeps_is_bounded_by_attempts(make_index: Callable[[], Index]) -> None:
    async def body(index: Index) -> None:
        await fill(index)
        cache = SplitCache(index, max_attempts=3 * ATTEMPTS)
        assert (await read(index, cache))[0] == JOBS * ATTEMPTS
        assert cache.held <= 3 * ATTEMPTS
        # the jobs it dropped are read again, the three it kept are not
        assert (await read(index, cache))[0] == (JOBS - 3) * ATTEMPTS

    run(make_index, body)


def test_what_the_cache_keeps_is_bounded_in_bytes(make_index: Callable[[], Index]) -> None:
    """#58: the bound was attempts only (100,000: up to ~0.75 GB with attempts of 55
    records); a kept job now counts its measured bytes (`kept_bytes`: attempts and
    segments), and the bytes bound holds whatever the attempts bound allows. Full of jobs
    read just now, it keeps them and no new one (a view over more jobs than fit re-splits
    only those that do not, not all of them: least-recently-used would keep none); a job
    not read for `RECENT_S` makes room."""
    from megacache_server.service.ett import split_cache

    async def body(index: Index) -> None:
        await fill(index)
        whole = SplitCache(index)
        await read(index, whole)
        sizes = [k.size for k in whole._kept.values()]
        assert sum(sizes) == whole.held_bytes and min(sizes) >= split_cache.kept_bytes(
            ATTEMPTS, 2 * ATTEMPTS)  # a start and training each, at least
        cap = sum(sizes[:3]) + 100
        cache = SplitCache(index, max_bytes=cap)
        assert (await read(index, cache))[0] == JOBS * ATTEMPTS
        assert 0 < cache.held_bytes <= cap and cache.held == 3 * ATTEMPTS
        kept = set(cache._kept)
        assert (await read(index, cache))[0] == (JOBS - 3) * ATTEMPTS
        assert set(cache._kept) == kept  # the same three: a scan does not flush them
        for k in cache._kept.values():
            k.read_at -= split_cache.RECENT_S + 1  # not read for a while: room is made
        stamps = await index.recent_progress_stamps(namespace="t", since=0, limit=1000)
        others = [s for s in stamps if s[:2] not in kept][:3]
        await cache.splits(others, compile_s)
        assert set(cache._kept) == {s[:2] for s in others} and cache.held_bytes <= cap

    run(make_index, body)


def test_a_lane_is_reentered_by_the_task_that_holds_it() -> None:
    """A view's request holds its namespace's lane (`service.limits.views`) and the splits it
    reads take it again: the same task passes at once; another task still waits."""
    import asyncio

    from megacache_server.service.ett import split_cache

    async def body() -> None:
        lane = split_cache.Lane()
        order: list[str] = []

        async def other() -> None:
            async with lane:
                order.append("other")

        async with lane:
            task = asyncio.create_task(other())
            await asyncio.sleep(0.01)
            async with lane:
                order.append("inner")
            await asyncio.sleep(0.01)
            order.append("outer")
        await asyncio.wait_for(task, 2.0)
        assert order == ["inner", "outer", "other"]

    asyncio.run(body())


def test_a_namespace_s_views_take_at_most_their_share_of_the_time() -> None:
    """`Lane`: a namespace's reads go one at a time, and after a read that took `d`, its
    next one waits `d * (1/VIEW_SHARE - 1)` (capped): a tenant reading in a loop gets at
    most VIEW_SHARE of the process, whatever its reads cost. A read cancelled while it
    waits frees the lane."""
    import asyncio

    from megacache_server.service.ett import split_cache

    async def body() -> None:
        lane = split_cache.Lane()
        starts: list[float] = []

        async def read(cost: float) -> None:
            async with lane:
                starts.append(time.monotonic())
                time.sleep(cost)  # CPU the read holds the process for

        began = time.monotonic()
        await asyncio.gather(*(read(0.05) for _ in range(4)))
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        wanted = 0.05 / split_cache.VIEW_SHARE
        assert all(g >= wanted * 0.95 for g in gaps), gaps
        busy = 4 * 0.05 / (time.monotonic() - began)
        assert busy <= split_cache.VIEW_SHARE * 1.4, busy
        waiting = asyncio.create_task(read(0.0))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.wait_for(read(0.0), 1.0)  # the cancelled reader left the lane free

    asyncio.run(body())
