"""`precompile_verify.check`: a publish round that does not wait gets the artifacts under
check as pending at once (the rest of the compile ships), the check runs in a real child
process of its own, and its verdict is kept per content. Real child process; the artifact
is bytes no torch can load, so the verdict is a failure and no round follows it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from conftest import need

from megacache_client.torch import precompile_verify

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
