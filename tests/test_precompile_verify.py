"""`precompile_verify.check`: a publish round that does not wait gets the artifacts under
check as pending at once (the rest of the compile ships), the check runs in a real child
process of its own, and its verdict is kept per content. Real child process; the artifact
is bytes no torch can load, so the verdict is a failure and no round follows it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
from conftest import need

from megacache_client.torch.precompile import verify as precompile_verify

need("torch", "the check's child process imports torch")

KIND = "precompile"


@dataclass
class Artifact:
    key: str
    content: bytes


def test_a_round_that_does_not_wait_gets_the_unchecked_as_pending() -> None:
    art = Artifact("k-pending", b"not a pickle of a precompile entry")
    rounds: list[str] = []
    started = threading.Event()
    real_run_child = precompile_verify._run_child

    def held_child(todo: list) -> dict[str, str]:  # the child starts after the call returned
        started.wait(60)
        return real_run_child(todo)

    precompile_verify._run_child = held_child
    try:
        now = precompile_verify.check({KIND: [art]}, KIND, wait=False,
                                      on_verdicts=lambda: rounds.append("round"))
        assert now.pending == {"k-pending"} and now.failed == {}
        again = precompile_verify.check({KIND: [art]}, KIND, wait=False)  # no second child
        assert again.pending == {"k-pending"}
        started.set()
        done = precompile_verify.check({KIND: [art]}, KIND, wait=True)  # the exit's way
    finally:
        precompile_verify._run_child = real_run_child
    assert done.pending == frozenset() and set(done.failed) == {"k-pending"}, done
    assert rounds == []  # nothing verified: no round to add it
    later = precompile_verify.check({KIND: [art]}, KIND, wait=False)  # kept per content
    assert later.pending == frozenset() and later.failed == done.failed


def test_a_refusal_on_the_artifact_stands_for_the_next_machine_that_traces_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer's check that refuses an artifact on the artifact itself (here: bytes no
    torch can load, checked in a real child) names its key in the bundle's meta; a new
    machine that traces the same key again leaves it out without starting a child (its
    exit waited seconds for the same answer before), and says so in its own meta."""
    from megacache_client.torch import precompile

    art = Artifact("k-refused", b"the producer's trace, which no torch can load")
    kept, note, refused = precompile.verified_for_shipping({KIND: [art]}, set(), wait=True)
    assert kept[KIND] == [] and "not verified" in note and refused == {"k-refused"}
    meta = precompile.producer_meta(kept, refused)
    assert meta.keys() == {precompile.META_REFUSED, precompile.META_REFUSED_AT}
    assert meta[precompile.META_REFUSED] == "k-refused"

    children: list[object] = []
    monkeypatch.setattr(precompile_verify, "_run_child",
                        lambda todo: children.append(todo) or {a.key: "" for a in todo})
    again = Artifact("k-refused", b"a new machine's trace of it (other bytes)")
    fresh = Artifact("k-fresh", b"a trace nobody refused")
    kept, note, refused = precompile.verified_for_shipping(
        {KIND: [again, fresh]}, set(), refused_before=precompile.refused_by([meta]),
        wait=True)
    assert [a.key for a in kept[KIND]] == ["k-fresh"] and "producer" in note
    assert refused == {"k-refused"}
    assert [[a.key for a in todo] for todo in children] == [["k-fresh"]]  # one child, fresh only


def test_a_refusal_expires_a_day_after_it_was_made_and_carrying_it_never_renews_it() -> None:
    """#58: any writer could mark keys refused and deny precompiled Dynamo to every consumer
    for good (each republish carried the mark on). A refusal counts a day from when it was
    first made (a bundle that carries it says that time), and not at all without one."""
    from megacache_client.torch import precompile

    made = time.time() - 3600
    meta = precompile.producer_meta({}, {"k"}, made)
    assert precompile.refused_by([meta]) == {"k"}
    assert precompile.refused_since([meta]) == int(made)
    carried = precompile.producer_meta({}, precompile.refused_by([meta]),
                                       precompile.refused_since([meta]))
    assert carried == meta  # the time it was first made, not now's
    assert precompile.refused_by([meta], now=made + 86400 + 1) == frozenset()
    assert precompile.refused_by([{precompile.META_REFUSED: "k"}]) == frozenset()
    assert precompile.refused_by([{**meta, precompile.META_REFUSED_AT: "soon"}]) == frozenset()


def test_a_check_whose_process_failed_refuses_nothing_for_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout on a busy machine is no verdict on the artifact: it stays out of this
    publish but is not named refused, so the next machine checks it again."""
    from megacache_client.torch import precompile

    monkeypatch.setattr(precompile_verify, "TIMEOUT_S", 0.01)
    art = Artifact("k-timed-out", b"bytes whose check never got to run")
    kept, note, refused = precompile.verified_for_shipping({KIND: [art]}, set(), wait=True)
    assert kept[KIND] == [] and "did not finish" in note
    assert refused == frozenset()
    assert precompile.producer_meta(kept, refused) == {}
