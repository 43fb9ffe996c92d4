"""Heartbeats coalesced per server process (`service/ett/beats.py`): the same summary as the
index's fold of every batch, a bounded buffer, and on a real server (each backend) seen at
once by the process that was sent them, by a second worker within the flush interval, and
kept through a clean stop (SIGTERM)."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from conftest import BACKENDS, _configured, backend_args
from helpers import ServerProcess

from megacache_client.wire import routes
from megacache_client.wire.progress import PhaseSpan, ProgressRecord
from megacache_server.service.ett.beats import Beats
from megacache_server.store.index.progress import AttemptProgress, Fold, merge


class FoldingIndex:
    """`add_progress_many` folding into a dict with `merge` (the index's rule), recording
    each call's size."""

    def __init__(self) -> None:
        self.summaries: dict[tuple[str, str, int], AttemptProgress] = {}
        self.calls: list[int] = []

    async def add_progress_many(self, folds: list[Fold], *,
                                namespace_attempts: int | None = None) -> None:
        self.calls.append(len(folds))
        for f in folds:
            key = (f.namespace, f.job, f.attempt)
            self.summaries[key] = merge(self.summaries.get(key), f.attempt, f.model,
                                        f.records, f.now, f.count)


def beat(at: float, step: int) -> ProgressRecord:
    return ProgressRecord(kind="heartbeat", at=at, step=step)


def test_coalesced_beats_fold_to_what_every_batch_would() -> None:
    """Random batches (heartbeats out of order, saves and ends among them), through the
    buffer with flushes at random points, end as the same summaries as each batch folded
    straight into the index; each flush is one index call."""
    rng = random.Random(41)
    base = 1_700_000_000.0

    async def run() -> None:
        direct, buffered = FoldingIndex(), FoldingIndex()
        beats = Beats(buffered, flush_s=1.0, max_entries=1000)  # type: ignore[arg-type]
        for i in range(600):
            job, attempt = f"j{rng.randrange(5)}", rng.randrange(2)
            records = [beat(base + rng.uniform(0, 1000), rng.randrange(100))
                       for _ in range(rng.randrange(1, 4))]
            if rng.random() < 0.1:
                records.append(ProgressRecord(kind="checkpoint_save", at=base + i, step=i,
                                              blocking_s=1.0))
            now = base + 2000 + i
            await direct.add_progress_many([Fold("ns", job, attempt, None, records, now,
                                                 len(records))])
            await beats.add("ns", job, attempt, None, records, now)
            if rng.random() < 0.05:
                await beats.flush()
        await beats.flush()
        assert not beats.pending
        assert buffered.summaries == direct.summaries
        assert len(buffered.calls) < len(direct.calls) / 3

    anyio.run(run)


def test_a_summary_is_stored_as_asdict_would_write_it() -> None:
    """`AttemptProgress.to_json` (hand-rolled for speed) writes what `dataclasses.asdict`
    would, and reads back equal."""
    base = 1_700_000_000.0
    records = [ProgressRecord(kind="start", at=base, allocation_start=base - 5),
               ProgressRecord(kind="training", at=base + 10, phases=[
                   PhaseSpan(phase="distributed", at=base + 2, seconds=1.5, count=3)]),
               beat(base + 20, 3),
               *(ProgressRecord(kind="checkpoint_save", at=base + 30 + k, step=k,
                                blocking_s=0.5 * k, background_s=1.0) for k in range(40)),
               ProgressRecord(kind="checkpoint_load", at=base + 90, blocking_s=2.0, step=1),
               ProgressRecord(kind="end", at=base + 100, reason="failed", cause="exit_code",
                              detail="exit code 3", exit_code=3),
               ProgressRecord(kind="failure", at=base + 99, cause="killed", detail="SIGSEGV")]
    summary = merge(None, 3, "m", records, base + 101)
    assert summary.phases and summary.failure and summary.end_cause == "exit_code"
    assert summary.to_json() == json.dumps(dataclasses.asdict(summary), separators=(",", ":"))
    assert AttemptProgress.from_json(summary.to_json()) == summary


def test_buffer_stays_bounded_under_a_flood() -> None:
    """10,000 attempts' heartbeats with room for 100: never more than 100 held, each write
    carries at most 100, and nothing is lost."""
    async def run() -> None:
        index = FoldingIndex()
        beats = Beats(index, flush_s=60.0, max_entries=100)  # type: ignore[arg-type]
        most = 0
        for i in range(10_000):
            await beats.add("ns", f"job-{i}", 0, None, [beat(1_700_000_000.0 + i, i)],
                            1_700_000_000.0 + i)
            for _ in range(3):  # the same attempt again: no new entry
                await beats.add("ns", f"job-{i}", 0, None, [beat(1_700_000_001.0 + i, i)],
                                1_700_000_001.0 + i)
            most = max(most, len(beats.pending))
        await beats.flush()
        assert most <= 100 and max(index.calls) <= 100
        assert len(index.summaries) == 10_000
        assert all(s.records == 4 for s in index.summaries.values())

    anyio.run(run)


def test_a_batch_with_other_records_writes_through_with_its_buffered_beats() -> None:
    async def run() -> None:
        index = FoldingIndex()
        beats = Beats(index, flush_s=60.0, max_entries=10)  # type: ignore[arg-type]
        await beats.add("ns", "j", 0, "m", [beat(1_700_000_100.0, 7)], 1_700_000_200.0)
        assert not index.summaries
        await beats.add("ns", "j", 0, None, [ProgressRecord(
            kind="end", at=1_700_000_150.0, reason="finished")], 1_700_000_201.0)
        s = index.summaries[("ns", "j", 0)]
        assert s.last_heartbeat == (1_700_000_100.0, 7) and s.end_at == 1_700_000_150.0
        assert s.model == "m" and s.records == 2 and not beats.pending

    anyio.run(run)


# -- on a real server ------------------------------------------------------------------
def post(c: httpx.Client, job: str, records: list[dict[str, Any]]) -> None:
    r = c.post(routes.JOB_PROGRESS.url(job=job), json={"attempt": 0, "records": records})
    assert r.status_code == 202, r.text


def last_fact(c: httpx.Client, job: str) -> float:
    r = c.get(f"/v1/jobs/{job}/ett")
    assert r.status_code == 200, r.text
    return float(r.json()["end"])


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> tuple[str, list[str], dict[str, str]]:
    args, env = backend_args(request.param, request)
    return request.param, args, env


def server(backend: tuple[str, list[str], dict[str, str]], data: Path,
           **env: str) -> ServerProcess:
    name, args, base_env = backend
    return _configured(ServerProcess(data, *args, env={**base_env, **env}), name, args)


def test_beats_seen_at_once_here_and_kept_through_sigterm(
        backend: tuple[str, list[str], dict[str, str]], tmp_path: Path) -> None:
    """A flush interval of 60 s: the server that was sent a heartbeat shows it at once; a
    second server on the same storage does not yet (it is buffered); SIGTERM writes it, so
    the second server sees it, and so does the first once restarted on the same data."""
    data = tmp_path / "data"
    a = server(backend, data, MEGACACHE_PROGRESS_FLUSH_S="60").start()
    b = server(backend, data, MEGACACHE_PROGRESS_FLUSH_S="60").start()
    try:
        now = time.time()
        with httpx.Client(base_url=a.url, timeout=30) as ca, \
                httpx.Client(base_url=b.url, timeout=30) as cb:
            post(ca, "sig", [{"kind": "start", "at": now - 100},
                             {"kind": "training", "at": now - 90}])  # written through
            post(ca, "sig", [{"kind": "heartbeat", "at": now - 5, "step": 50}])
            assert last_fact(ca, "sig") == pytest.approx(now - 5, abs=0.01)
            post(ca, "sig", [{"kind": "heartbeat", "at": now - 2, "step": 60}])
            # b has what a's read above flushed, not the newer beat a holds
            assert last_fact(cb, "sig") == pytest.approx(now - 5, abs=0.01)
            a.stop()  # SIGTERM
            assert last_fact(cb, "sig") == pytest.approx(now - 2, abs=0.01)
        a.start()
        with httpx.Client(base_url=a.url, timeout=30) as ca:
            assert last_fact(ca, "sig") == pytest.approx(now - 2, abs=0.01)
    finally:
        a.stop()
        b.stop()
    for s in (a, b):
        assert "Traceback" not in s.log(), s.log()


def test_other_processes_see_beats_within_the_flush_interval(
        backend: tuple[str, list[str], dict[str, str]], tmp_path: Path) -> None:
    """A server of two workers with a 1 s flush is sent heartbeats (each on a new
    connection: the kernel spreads them over both workers); a second server on the same
    storage, which holds none of them, shows each within the flush interval and a margin
    for two shared cores (polled, with a deadline). Its own reads flush nothing of the
    first server's, so only the workers' periodic flush can make it pass."""
    flush_s, margin = 1.0, 4.0
    data = tmp_path / "data"
    workers = server(backend, data, MEGACACHE_WORKERS="2",
                     MEGACACHE_PROGRESS_FLUSH_S=str(flush_s)).start(timeout=60)
    other = server(backend, data, MEGACACHE_PROGRESS_FLUSH_S=str(flush_s)).start()
    try:
        now = time.time()
        with httpx.Client(base_url=workers.url, timeout=30) as c:
            post(c, "w2", [{"kind": "start", "at": now - 100},
                           {"kind": "training", "at": now - 90}])
        with httpx.Client(base_url=other.url, timeout=30) as reader:
            for k in range(4):
                at = time.time()
                with httpx.Client(base_url=workers.url, timeout=30) as c:
                    post(c, "w2", [{"kind": "heartbeat", "at": at, "step": 100 + k}])
                deadline = time.monotonic() + flush_s + margin
                while last_fact(reader, "w2") != pytest.approx(at, abs=0.01):
                    assert time.monotonic() < deadline, f"beat {k} not seen in time"
                    time.sleep(0.05)  # polling, bounded by the deadline
    finally:
        workers.stop()
        other.stop()
    for s in (workers, other):
        assert "Traceback" not in s.log(), s.log()
