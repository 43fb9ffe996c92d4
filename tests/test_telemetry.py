"""Job telemetry (#41): rank 0's progress records, their queue, their sender, and what a
server that is down or hung costs the training loop (nothing).

The peer is a real HTTP server on loopback that records what it is sent
(tests/progress_peer.py); the trainers are real processes that enable the client zero-code
(tests/ett_train_job.py) and checkpoint with torch.distributed.checkpoint. The same job
against the real server's split is tests/test_ett_e2e.py."""

from __future__ import annotations

import json
import math
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import cast

import pytest
from conftest import need
from progress_peer import ProgressPeer, recording

from benchmarks.harness.machines import Machine, run_job
from megacache_client.config import ClientConfig, ConfigError
from megacache_client.ett import sender as p
from megacache_client.ett.sender import ProgressQueue, ProgressSender
from megacache_client.job import JobIdentity, allocation_start
from megacache_client.wire.progress import MAX_RECORDS, PhaseSpan, ProgressRecord

HERE = Path(__file__).resolve().parent
NOW = time.time()
ROUNDING = 0.0005
"""Durations go on the wire to the millisecond."""


# -- the records ----------------------------------------------------------------------------
def test_record_builders_make_valid_records_and_mend_what_a_clock_spoils() -> None:
    start = p.start_record(NOW, NOW - 60)
    assert (start.kind, start.at, start.allocation_start) == ("start", NOW, NOW - 60)
    # an allocation after the process's start is a wrong setting: dropped, not refused
    assert p.start_record(NOW, NOW + 5).allocation_start is None
    assert p.heartbeat_record(NOW, -3).step == 0
    save = p.checkpoint_save_record(NOW, 7, -0.5, math.nan)
    assert (save.step, save.blocking_s, save.background_s) == (7, 0.0, None)
    assert p.checkpoint_save_record(NOW, 7, 1.23456, 9e9).to_dict()["background_s"] == \
        7 * 24 * 3600.0
    load = p.checkpoint_load_record(NOW, 0.25)
    assert (load.kind, load.blocking_s, load.step) == ("checkpoint_load", 0.25, None)
    assert p.end_record(NOW, "failed").reason == "failed"
    assert p.training_record(NOW).to_dict() == {"kind": "training", "at": NOW, "step": None,
                                                "blocking_s": None, "background_s": None,
                                                "allocation_start": None, "reason": None}
    with pytest.raises(ValueError):  # a broken clock: the record is refused at its maker
        p.heartbeat_record(12.0, 1)


def test_allocation_start_from_the_setting_or_slurm() -> None:
    assert allocation_start({"MEGACACHE_JOB_START": "1764800000.5"}) == 1764800000.5
    assert allocation_start({"MEGACACHE_JOB_START": "2025-12-03T22:13:20Z"}) == 1764800000.0
    assert allocation_start({"SLURM_JOB_START_TIME": "1764800000"}) == 1764800000.0
    assert allocation_start({"MEGACACHE_JOB_START": "1764800001",
                             "SLURM_JOB_START_TIME": "1764800000"}) == 1764800001.0
    for bad in ("soon", "2025-12-03T22:13:20", "nan", "-5", "inf"):  # no zone: no instant
        assert allocation_start({"MEGACACHE_JOB_START": bad}) is None, bad
    assert allocation_start({}) is None


def test_the_settings_switch_and_the_heartbeat() -> None:
    assert ClientConfig.from_env({}).telemetry is True
    assert ClientConfig.from_env({"MEGACACHE_TELEMETRY": "0"}).telemetry is False
    assert ClientConfig.from_env({"MEGACACHE_HEARTBEAT_S": "2.5"}).heartbeat_s == 2.5
    for bad in ("0", "-1", "7200"):
        with pytest.raises(ConfigError, match="MEGACACHE_HEARTBEAT_S"):
            ClientConfig.from_env({"MEGACACHE_HEARTBEAT_S": bad})
    with pytest.raises(ConfigError, match="MEGACACHE_TELEMETRY"):
        ClientConfig.from_env({"MEGACACHE_TELEMETRY": "maybe"})


# -- the queue ------------------------------------------------------------------------------
def beat(step: int) -> ProgressRecord:
    return p.heartbeat_record(NOW + step, step)


def test_a_full_queue_drops_the_oldest_heartbeat_first_then_the_oldest_record() -> None:
    q = ProgressQueue(limit=4)
    q.put(p.start_record(NOW))
    for step in range(1, 6):
        q.put(beat(step))
    assert len(q) == 4 and q.dropped == 2
    kept = q.take(10, 0)
    assert [r.kind for r in kept] == ["start", "heartbeat", "heartbeat", "heartbeat"]
    assert [r.step for r in kept[1:]] == [3, 4, 5]
    q = ProgressQueue(limit=2)
    for step in range(3):
        q.put(p.checkpoint_save_record(NOW, step, 0.1))
    assert [r.step for r in q.take(10, 0)] == [1, 2] and q.dropped == 1


def test_records_put_back_go_in_front_in_order_and_the_queue_stays_bounded() -> None:
    q = ProgressQueue(limit=5)
    q.put(beat(10))
    q.put_back([p.start_record(NOW), beat(1)])
    assert [r.step for r in q.take(2, 0)] == [None, 1]
    q.put_back([beat(i) for i in range(8)])  # more than fit: the oldest make room
    assert len(q) == 5 and q.dropped == 4
    assert q.take(MAX_RECORDS, 0)[-1].step == 10


def test_take_waits_for_a_record_and_never_more_than_asked() -> None:
    q = ProgressQueue()
    began = time.monotonic()
    assert q.take(5, 0.1) == [] and time.monotonic() - began >= 0.09
    threading.Timer(0.05, q.put, args=(beat(1),)).start()
    assert [r.step for r in q.take(5, 5)] == [1]
    for i in range(MAX_RECORDS + 3):
        q.put(beat(i))
    assert len(q.take(MAX_RECORDS, 0)) == MAX_RECORDS and len(q) == 3


# -- the sender -----------------------------------------------------------------------------
def config(url: str, tmp_path: Path, **kw: object) -> ClientConfig:
    return ClientConfig(url=url, node_cache_dir=tmp_path / "node", retries=0, **kw)  # type: ignore[arg-type]


def test_batches_reach_the_peer_whole_and_in_order(tmp_path: Path) -> None:
    with recording() as peer:
        sender = ProgressSender(config(peer.url, tmp_path), "job-1", 3, model=lambda: "mlp").start()
        sender.put(p.start_record(NOW))
        sender.put_all(beat(i) for i in range(1, MAX_RECORDS + 10))
        assert sender.flush(10)
        assert [r.get("step") for r in peer.records()] == [None, *range(1, MAX_RECORDS + 10)]
        assert len(peer.batches) >= 2 and {j for j, _ in peer.batches} == {"job-1"}
        assert all(b["attempt"] == 3 and b["model"] == "mlp" and len(b["records"]) <=
                   MAX_RECORDS for _, b in peer.batches)
        assert sender.sent == MAX_RECORDS + 10 and not peer.invalid
        sender.stop("test")


def test_a_refused_batch_is_dropped_and_a_server_without_the_route_stops_it(
        tmp_path: Path) -> None:
    with recording(status=422) as peer:
        sender = ProgressSender(config(peer.url, tmp_path), "job-1", 0).start()
        sender.put(beat(1))
        assert sender.flush(10) and sender.refused == 1 and not sender.stopped
        sender.put(beat(2))  # still sending
        assert sender.flush(10) and sender.refused == 2
        sender.stop("test")
    with recording(status=404) as peer:
        sender = ProgressSender(config(peer.url, tmp_path), "job-1", 0).start()
        sender.put(beat(1))
        assert sender.flush(10) and "refused progress" in sender.stopped
        sender.put(beat(2))
        assert len(sender.queue) == 0  # nothing more is kept


def test_a_server_from_before_the_causes_still_gets_the_start_and_the_end(
        tmp_path: Path) -> None:
    """A server that refuses what it does not know (a cause, the phases) is sent the same
    batch without them: it loses the why and the where, not the first step or the end."""
    spans = [PhaseSpan(phase="distributed", at=NOW, seconds=0.5, count=2)]
    with recording(older=True) as peer:
        sender = ProgressSender(config(peer.url, tmp_path), "job-1", 0).start()
        sender.put_all([p.start_record(NOW), p.training_record(NOW + 1, spans),
                        p.end_record(NOW + 2, "failed", "oom", "torch.OutOfMemoryError")])
        assert sender.flush(10) and sender.refused == 0, peer.invalid
        kinds = {r["kind"]: r for r in peer.records()}
        assert set(kinds) >= {"start", "training", "end"}
        assert kinds["end"]["reason"] == "failed" and "cause" not in kinds["end"]
        assert "phases" not in kinds["training"] and peer.invalid  # refused once, then sent
        sender.stop("test")
    with recording() as peer:  # today's server: all of it
        sender = ProgressSender(config(peer.url, tmp_path), "job-1", 0).start()
        sender.put(p.end_record(NOW + 2, "failed", "oom", "torch.OutOfMemoryError"))
        assert sender.flush(10)
        (end,) = [r for r in peer.records() if r["kind"] == "end"]
        assert (end["cause"], end["detail"]) == ("oom", "torch.OutOfMemoryError")
        sender.stop("test")


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    return f"http://127.0.0.1:{port}"


def test_a_dead_server_keeps_the_records_for_later_and_blocks_no_one(tmp_path: Path) -> None:
    sender = ProgressSender(config(dead_url(), tmp_path), "job-1", 0, retry_s=30).start()
    began = time.monotonic()
    for i in range(100):
        sender.put(beat(i))
    assert time.monotonic() - began < 0.1
    deadline = time.monotonic() + 10
    while not sender.failing and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sender.failing and sender.sent == 0
    assert len(sender.queue) == 100  # put back, waiting for the server
    sender.stop("test")


# -- the hooks, in this process -------------------------------------------------------------
@pytest.fixture
def telemetry_on(tmp_path: Path) -> Iterator[list[object]]:
    """Start telemetry here for a job; stopped (hooks removed) after the test."""
    need("torch", "the hooks are torch's")
    from megacache_client.ett import telemetry

    started: list[object] = []
    yield started
    for t in started:
        t.stop("test over")  # type: ignore[attr-defined]
    assert telemetry.active() is None


def heartbeats(t: object, n: int) -> threading.Event:
    """Set once `t` (a running `Telemetry`) has put `n` more heartbeats in its queue: what a
    test waits on instead of sleeping for as long as it guesses they take."""
    sender = t.progress  # type: ignore[attr-defined]
    done, made, put = threading.Event(), [0], sender.put

    def counting(record: ProgressRecord | None) -> None:
        put(record)
        if record is not None and record.kind == "heartbeat":
            made[0] += 1
            if made[0] >= n:
                done.set()

    sender.put = counting
    return done


def start_here(url: str, tmp_path: Path, started: list[object], **kw: object) -> object:
    from megacache_client.ett import telemetry

    t = telemetry.start(config(url, tmp_path, **kw), JobIdentity(job_id="job-7", attempt=0),
                        NOW - 5)
    assert t is not None
    started.append(t)
    return t


def test_off_without_a_job_off_the_switch_and_off_rank_0(tmp_path: Path) -> None:
    need("torch", "the hooks are torch's")
    from megacache_client.ett import telemetry

    cfg = config("http://127.0.0.1:9", tmp_path)
    assert telemetry.start(cfg, JobIdentity(), NOW) is None
    assert telemetry.start(cfg, JobIdentity(job_id="j", rank=1, world_size=2), NOW) is None
    assert telemetry.start(config("http://127.0.0.1:9", tmp_path, telemetry=False),
                           JobIdentity(job_id="j"), NOW) is None
    assert telemetry.start(ClientConfig(), JobIdentity(job_id="j"), NOW) is None  # no URL
    assert telemetry.active() is None


def test_steps_checkpoints_and_the_end_reach_the_peer(tmp_path: Path, telemetry_on) -> None:
    import torch
    import torch.distributed.checkpoint as dcp  # imported before: patched at start

    import megacache_client

    with recording() as peer:
        t = start_here(peer.url, tmp_path, telemetry_on, heartbeat_s=0.1)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        dcp.save({"m": model.state_dict()}, checkpoint_id=str(tmp_path / "c1"))
        cast(Future, dcp.async_save({"m": model.state_dict()},
                                    checkpoint_id=str(tmp_path / "c2"))).result()
        dcp.load({"m": model.state_dict()}, checkpoint_id=str(tmp_path / "c1"))
        with megacache_client.checkpoint(step=99):
            time.sleep(0.2)
        said = time.time()
        megacache_client.checkpoint_saved(0.5, background_s=1.5, step=100)
        megacache_client.checkpoint_loaded(0.25, step=40)
        assert heartbeats(t, 2).wait(10)
        t.end("finished")  # type: ignore[attr-defined]
        recs = peer.records("job-7")
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "start" and recs[0]["at"] == pytest.approx(NOW - 5)
    assert kinds[-1] == "end" and recs[-1]["reason"] == "finished"
    assert kinds.count("training") == 1 and kinds.count("heartbeat") >= 2
    saves = [r for r in recs if r["kind"] == "checkpoint_save"]
    assert [s["step"] for s in saves] == [3, 3, 99, 100], saves
    assert saves[1]["background_s"] is not None and saves[0]["background_s"] is None
    assert 0.19 <= saves[2]["blocking_s"] < 1.0
    assert saves[3]["at"] == pytest.approx(said - 2.0, abs=0.05)  # it began 2 s before
    loads = [r for r in recs if r["kind"] == "checkpoint_load"]
    assert len(loads) == 2 and loads[0]["step"] is None
    assert (loads[1]["blocking_s"], loads[1]["step"]) == (0.25, 40)
    assert max(r["step"] for r in recs if r["kind"] == "heartbeat") == 3


def test_a_heartbeat_due_as_the_attempt_ends_goes_before_the_end(tmp_path: Path,
                                                                 telemetry_on) -> None:
    """The heartbeat thread making a beat when the trainer ends (CI saw it: a failed
    trainer's last record a heartbeat): the end waits for that beat, and is the last record."""
    import torch

    with recording() as peer:
        t = start_here(peer.url, tmp_path, telemetry_on, heartbeat_s=0.05)
        model = torch.nn.Linear(4, 4)
        torch.optim.SGD(model.parameters(), lr=0.1).step()  # trains: the sender is armed
        in_beat, release, beat = threading.Event(), threading.Event(), []
        alive = t.alive  # type: ignore[attr-defined]

        def held(at: float) -> ProgressRecord:
            if threading.current_thread().name == "megacache-heartbeat" and not beat:
                beat.append(threading.current_thread())
                in_beat.set()
                release.wait(10)
            return alive(at)

        t.alive = held  # type: ignore[attr-defined]
        assert in_beat.wait(10)
        ender = threading.Thread(target=t.end, args=("finished",))  # type: ignore[attr-defined]
        ender.start()
        ender.join(0.3)  # the end meets the beat being made (without the lock: ends first)
        release.set()
        ender.join(10)
        beat[0].join(10)
        assert t.progress.flush(5)  # type: ignore[attr-defined]
        kinds = peer.kinds("job-7")
    assert kinds[-1] == "end" and kinds.count("end") == 1, kinds[-4:]


def test_a_process_that_never_trains_sends_nothing(tmp_path: Path, telemetry_on) -> None:
    """torchrun's agent imports torch with the job's variables (no RANK: "rank 0"): its
    start, heartbeats and exit must not enter the job's time line."""
    with recording() as peer:
        t = start_here(peer.url, tmp_path, telemetry_on, heartbeat_s=0.05)
        assert heartbeats(t, 5).wait(10)
        assert len(t.progress.queue) >= 5  # type: ignore[attr-defined]  # kept, not sent
        began = time.monotonic()
        t.end("finished")  # type: ignore[attr-defined]
        assert time.monotonic() - began < 0.1
        sender = t.progress._thread  # type: ignore[attr-defined]
        sender.join(10)  # the sender has ended: nothing can be sent after this
        assert not sender.is_alive() and peer.batches == []


def test_the_first_step_sends_what_waited(tmp_path: Path, telemetry_on) -> None:
    import torch

    with recording() as peer:
        t = start_here(peer.url, tmp_path, telemetry_on, heartbeat_s=0.05)
        assert heartbeats(t, 3).wait(10)
        assert peer.batches == []
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1).step()
        assert t.progress.flush(5)  # type: ignore[attr-defined]
        kinds = peer.kinds()
        assert kinds[0] == "start" and kinds.count("heartbeat") >= 3 and "training" in kinds


def test_an_uncaught_exception_ends_failed_after_the_trainer_s_own_hook(
        tmp_path: Path, telemetry_on, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from megacache_client.ett import telemetry

    seen: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(str(value)))
    monkeypatch.setenv("MEGACACHE_JOB_START", str(NOW - 50))
    with recording() as peer:
        t = telemetry.start(config(peer.url, tmp_path), JobIdentity(job_id="job-8", attempt=2),
                            NOW - 5)
        assert t is not None
        telemetry_on.append(t)
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1).step()
        sys.excepthook(RuntimeError, RuntimeError("boom"), None)
        recs = peer.records("job-8")
    assert seen == ["boom"]  # the trainer's hook ran, and first
    assert recs[-1]["kind"] == "end" and recs[-1]["reason"] == "failed"
    assert recs[0]["allocation_start"] is None  # a restart is not the allocation
    assert {b["attempt"] for _, b in peer.batches} == {2}


def test_a_hung_server_costs_the_loop_nothing(hanging_server: str, tmp_path: Path,
                                              telemetry_on) -> None:
    """The server accepts and never answers: the sender waits on it in its own thread
    while every step, checkpoint and the exit go on as if it were not there."""
    import torch
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()

    def step_times(n: int) -> list[float]:
        out = []
        for _ in range(n):
            began = time.perf_counter()
            opt.step()
            out.append(time.perf_counter() - began)
        return out

    step_times(200)  # warm
    without = statistics.median(step_times(2000))
    t = start_here(hanging_server, tmp_path, telemetry_on, heartbeat_s=0.05)
    first = time.perf_counter()
    opt.step()  # the first step sends `training`: queued, not sent
    assert time.perf_counter() - first < 0.05
    sender = t.progress  # type: ignore[attr-defined]

    def in_flight() -> int:  # taken from the queue, neither sent nor refused nor dropped
        return int(sender.queue.added - sender.settled - len(sender.queue))

    deadline = time.monotonic() + 5
    while not in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert in_flight()  # the sender is stuck in a POST the server holds
    with_hook = statistics.median(step_times(2000))
    assert with_hook - without < 50e-6, (with_hook, without)
    began = time.monotonic()
    dcp.save({"m": model.state_dict()}, checkpoint_id=str(tmp_path / "c"))
    assert time.monotonic() - began < 2.0
    assert t.step >= 2001  # type: ignore[attr-defined]
    assert in_flight() and sender.sent == 0  # all of it while the server held the POST
    began = time.monotonic()
    t.end("finished")  # type: ignore[attr-defined]  # the exit waits at most its bound
    assert time.monotonic() - began < 2.5


def test_a_dead_server_costs_the_exit_nothing(tmp_path: Path, telemetry_on) -> None:
    import torch

    t = start_here(dead_url(), tmp_path, telemetry_on, heartbeat_s=0.05)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    opt.step()
    deadline = time.monotonic() + 10
    while not t.progress.failing and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    tries = t.progress.tries  # type: ignore[attr-defined]
    began = time.monotonic()
    t.end("finished")  # type: ignore[attr-defined]
    # the end is tried once more at once (a server back from an outage gets it), and a
    # refused connection ends the wait
    assert time.monotonic() - began < 1.0
    assert t.progress.tries > tries  # type: ignore[attr-defined]


def test_a_checkpoint_module_imported_later_is_patched_on_import() -> None:
    need("torch", "the hooks are torch's")
    import subprocess

    code = ("import sys, torch\n"
            "from megacache_client.ett import checkpoints, frameworks\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules\n"
            "assert 'transformers' not in sys.modules and 'lightning' not in sys.modules\n"
            "checkpoints.watch_checkpoints(lambda: None)\n"
            "frameworks.watch()\n"
            "assert 'transformers' not in sys.modules  # watched, never imported by us\n"
            "import torch.distributed.checkpoint as dcp\n"
            "print(all(getattr(getattr(dcp, n), '_megacache_wrapped', False)"
            " for n in ('save', 'async_save', 'load')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "True", out.stderr[-2000:]


# -- real trainers, zero-code ---------------------------------------------------------------
def train(peer: ProgressPeer, tmp_path: Path, **env: str) -> tuple[dict, object]:
    """Run tests/ett_train_job.py zero-code against `peer`; (its ground truth, the run)."""
    need("torch", "the trainer is torch's")
    truth, ckpt = tmp_path / "truth.json", tmp_path / "ckpt"
    ckpt.mkdir()
    run = run_job(Machine(tmp_path / "node"), runner=[sys.executable,
                                                      str(HERE / "ett_train_job.py")],
                  env={"MEGACACHE_URL": peer.url, "MEGACACHE_JOB_ID": "train-1",
                       "MEGACACHE_HEARTBEAT_S": "0.2", "OMP_NUM_THREADS": "1",
                       "STEPS": "30", "CKPT_EVERY": "10", "STEP_S": "0.05",
                       "CKPT_DIR": str(ckpt), "TRUTH": str(truth), **env}, timeout=300)
    return (json.loads(truth.read_text()) if truth.exists() else {}), run


def test_a_trainer_sends_its_time_line_without_a_line_of_code(tmp_path: Path) -> None:
    with recording() as peer:
        truth, run = train(peer, tmp_path, MEGACACHE_JOB_START=str(NOW - 100))
        recs = peer.records("train-1")
    assert run.returncode == 0, run.stderr[-3000:]  # type: ignore[attr-defined]
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "start" and kinds[-1] == "end" and recs[-1]["reason"] == "finished"
    start = recs[0]
    # the process's start (by the kernel) comes before the script's first line
    assert truth["started"] - 5 < start["at"] <= truth["started"]
    assert start["allocation_start"] == pytest.approx(NOW - 100)
    training = next(r for r in recs if r["kind"] == "training")
    assert truth["first_step_end"] - 0.2 < training["at"] <= truth["first_step_end"]
    beats = [r for r in recs if r["kind"] == "heartbeat"]
    assert len(beats) >= 4 and beats[-1]["step"] <= 30
    assert [b["step"] for b in beats] == sorted(b["step"] for b in beats)
    saves = [r for r in recs if r["kind"] == "checkpoint_save"]
    assert [s["step"] for s in saves] == [10, 20, 30]
    for mine, theirs in zip(saves, truth["saves"], strict=True):
        # the client times the call from inside the trainer's own timing of it
        assert theirs["blocking_s"] - 0.05 <= mine["blocking_s"] <= theirs["blocking_s"] + ROUNDING
        assert mine["at"] == pytest.approx(theirs["at"], abs=0.05)
        assert mine["background_s"] is None
    loads = [r for r in recs if r["kind"] == "checkpoint_load"]
    assert len(loads) == 1 and loads[0]["step"] is None  # the resumed step is not known
    assert loads[0]["blocking_s"] <= truth["loads"][0]["blocking_s"] + ROUNDING
    assert not peer.invalid


def test_an_async_save_is_timed_on_the_loop_and_in_the_background(tmp_path: Path) -> None:
    with recording() as peer:
        truth, run = train(peer, tmp_path, SAVE="async")
        recs = peer.records("train-1")
    assert run.returncode == 0, run.stderr[-3000:]  # type: ignore[attr-defined]
    saves = [r for r in recs if r["kind"] == "checkpoint_save"]
    assert [s["step"] for s in saves] == [10, 20, 30]
    for mine, theirs in zip(saves, truth["saves"], strict=True):
        assert mine["blocking_s"] <= theirs["blocking_s"] + ROUNDING
        assert mine["background_s"] is not None and mine["background_s"] >= 0
    assert recs[0]["kind"] == "start" and recs[0]["allocation_start"] is None


def test_a_failed_trainer_ends_failed_and_the_one_line_api_counts(tmp_path: Path) -> None:
    with recording() as peer:
        truth, run = train(peer, tmp_path, SAVE="api", FAIL_AT="25")
        recs = peer.records("train-1")
    assert run.returncode == 1 and "simulated failure" in run.stderr  # type: ignore[attr-defined]
    assert recs[-1]["kind"] == "end" and recs[-1]["reason"] == "failed"
    saves = [r for r in recs if r["kind"] == "checkpoint_save"]
    assert [s["step"] for s in saves] == [10, 20]
    for mine, theirs in zip(saves, truth["saves"], strict=True):
        assert theirs["blocking_s"] - 0.05 <= mine["blocking_s"] <= theirs["blocking_s"] + ROUNDING


def test_the_switch_turns_it_off(tmp_path: Path) -> None:
    with recording() as peer:
        _, run = train(peer, tmp_path, MEGACACHE_TELEMETRY="0", STEPS="10")
        assert run.returncode == 0, run.stderr[-3000:]  # type: ignore[attr-defined]
        assert peer.batches == []
