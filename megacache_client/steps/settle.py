"""When to publish: once a compile has settled, not only when the process ends well.

A trainer killed with SIGKILL (preemption, an OOM kill, a lost node) runs no exit handler;
if its compile were published only at exit, every restart after such a failure would
compile cold, and those restarts are what time to recover is about. So the publish runs as
soon as there is something to publish: after the first compiled step, at the end of the
first optimizer step during which torch recorded no new cache artifact ("the step after
the compile completed"; forward and backward of a step are both compiled by then), in a
background thread, off the training loop. A later compile (a new shape, a recompile)
publishes again at the next settled point; the exit publishes what is left.

`Settler` is that rule and its thread: the optimizer step post hook only counts and wakes
it (a few attribute writes per step). A process that runs no optimizer (inference, a
custom loop) settles once torch has recorded nothing new for `quiet_s`. Rounds are capped
(`max_rounds`), and a round whose content a previous one shipped uploads nothing
(`publish.py` compares what it would ship with what it shipped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("megacache")

QUIET_S = 10.0
"""Without optimizer steps: torch recorded nothing new for this long = settled."""
MIN_WAKE_S = 0.2
"""The thread looks at most this often, however fast the loop steps."""
RETRY_S = (5.0, 120.0)
"""After a round that failed (the server down), the next one waits 5 s, doubling to 120 s."""


class Settler:
    """Runs `publish()` at each settled point with new artifacts, in its own thread.

    `recorded()` counts torch's cache artifacts so far (-1: unknown); `publish()` runs one
    round and says whether it reached the server (False: try again later). `step()` is
    what the optimizer step post hook calls.
    """

    def __init__(self, recorded: Callable[[], int], publish: Callable[[], bool], *,
                 max_rounds: int, quiet_s: float = QUIET_S) -> None:
        self.recorded = recorded
        self.publish = publish
        self.max_rounds = max_rounds
        self.quiet_s = quiet_s
        self.steps = 0
        self.rounds = 0
        self.published_at: int | None = None
        """The artifact count of the last round that reached the server."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, *_: object) -> None:
        """An optimizer step ended (the global step post hook): count it, wake the thread."""
        self.steps += 1
        if not self._wake.is_set():
            self._wake.set()

    def start(self) -> Settler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="megacache-settle",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        seen, seen_steps, changed = self.recorded(), self.steps, time.monotonic()
        retry_at, backoff = 0.0, RETRY_S[0]
        while not self._stop.is_set() and self.rounds < self.max_rounds:
            self._wake.wait(self.quiet_s / 4)
            self._wake.clear()
            if self._stop.wait(MIN_WAKE_S):
                return
            now, count = time.monotonic(), self.recorded()
            if count != seen:  # torch compiled (or loaded) something since the last look
                seen, seen_steps, changed = count, self.steps, now
                continue
            settled = self.steps > seen_steps or (
                self.steps == 0 and now - changed >= self.quiet_s)
            if not settled or count == self.published_at or count <= 0 or now < retry_at:
                continue
            self.rounds += 1
            try:
                reached = self.publish()
            except Exception as exc:  # the session catches its own; never kill the thread
                log.debug("megacache: publish round failed: %s", exc)
                reached = False
            if reached:
                self.published_at, backoff = count, RETRY_S[0]
            else:
                retry_at, backoff = now + backoff, min(backoff * 2, RETRY_S[1])
