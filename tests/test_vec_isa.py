"""Torch's CPU vector-ISA probe run in the background (megacache_client.torch.vec_isa).

The probe itself is torch's; what is ours is that it runs once, off the trainer's thread, and
that the trainer's first call waits for it instead of probing again. The probe is replaced
here by a counting stand-in with the same caching, in torch's own module (held mid-probe
until the test lets it finish), so a race shows as a second probe. The real probe on a real
start is covered in test_start.py.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import need

from megacache_client.torch import vec_isa

cpu_vec_isa = need("torch._inductor.cpu_vec_isa", "the ISA probe is torch's")


def stand_in(monkeypatch: pytest.MonkeyPatch, probe: Callable[[], Any]) -> list[str]:
    """Put a cached `probe` in torch's place, as this process's first; returns its callers."""
    calls: list[str] = []

    @functools.cache
    def valid_vec_isa_list() -> Any:
        calls.append(threading.current_thread().name)
        return probe()

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    monkeypatch.setattr(vec_isa, "_started", False)
    monkeypatch.setattr(vec_isa, "_probed_on", None)
    return calls


def test_the_trainer_waits_for_the_background_probe_instead_of_probing_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    probing, release = threading.Event(), threading.Event()

    def probe() -> list[str]:
        probing.set()
        release.wait(20)
        return ["avx2"]

    calls = stand_in(monkeypatch, probe)
    thread = vec_isa.probe_in_background()
    assert thread is not None and thread.name == vec_isa.THREAD_NAME
    assert probing.wait(10)  # the probe is under way, held there until `release` ...
    got: list[Any] = []
    trainer = threading.Thread(target=lambda: got.append(cpu_vec_isa.valid_vec_isa_list()),
                               name="trainer")
    trainer.start()
    # ... the trainer's call waits for it: its thread stands in the serialising wrapper
    # (on the lock the probe holds), or it probed again (a second call of torch's probe)
    wrapper = cpu_vec_isa.valid_vec_isa_list.__code__
    deadline = time.monotonic() + 20
    while len(calls) < 2 and getattr(sys._current_frames().get(trainer.ident or 0),
                                     "f_code", None) is not wrapper:
        assert time.monotonic() < deadline, "the trainer's call neither waited nor probed"
        time.sleep(0.01)
    assert calls == [vec_isa.THREAD_NAME] and got == []  # waiting, not probing again
    release.set()
    trainer.join(10)
    assert got == [["avx2"]] and calls == [vec_isa.THREAD_NAME]  # one probe, not two
    assert vec_isa.probed_on() == vec_isa.THREAD_NAME
    assert vec_isa.probe_in_background() is None  # once per process
    thread.join(5)
    cpu_vec_isa.valid_vec_isa_list.cache_clear()  # torch's cache controls still work
    assert cpu_vec_isa.valid_vec_isa_list() == ["avx2"] and len(calls) == 2


def test_a_failed_background_probe_leaves_the_trainer_to_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = iter([RuntimeError("dlopen probe failed"), ["avx512"]])

    def probe() -> list[str]:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    calls = stand_in(monkeypatch, probe)
    thread = vec_isa.probe_in_background()
    assert thread is not None
    thread.join(5)
    assert cpu_vec_isa.valid_vec_isa_list() == ["avx512"]  # probed again, on this thread
    assert calls == [vec_isa.THREAD_NAME, threading.current_thread().name]
    assert vec_isa.probed_on() == threading.current_thread().name


def test_an_unknown_probe_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def uncached() -> list[str]:  # not the cached function this client knows
        return ["vsx"]

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", uncached)
    monkeypatch.setattr(vec_isa, "_started", False)
    assert vec_isa.probe_in_background() is None
    assert cpu_vec_isa.valid_vec_isa_list is uncached


def test_a_process_forked_mid_probe_can_still_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DataLoader worker forked while the probe runs must not inherit its held lock."""
    parent = os.getpid()
    probing, forked = threading.Event(), threading.Event()

    def probe() -> list[str]:
        if os.getpid() == parent:  # the background probe: it holds the lock until the fork
            probing.set()
            forked.wait(20)
        return ["avx2"]

    stand_in(monkeypatch, probe)
    thread = vec_isa.probe_in_background()
    assert thread is not None
    assert probing.wait(10)  # the background probe holds the lock now, until `forked`
    pid = os.fork()
    if pid == 0:  # the child: its copy of the lock must be free, or this call never returns
        os._exit(0 if cpu_vec_isa.valid_vec_isa_list() == ["avx2"] else 1)
    forked.set()
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child deadlocked on the probe's lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    thread.join(5)
