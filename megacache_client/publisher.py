"""The publish side of a session: its rounds, the settled points that start them, the
precompile verdicts that add to them, and the rule of who may publish at all.

A round snapshots what torch recorded, uploads what the tracks' entries lack and remembers
what shipped (`steps/publish.py`). One runs at a time, in a background thread: at each
settled point after the first step (`steps/settle.py`), when a precompile check verified
entries, at SIGTERM, and at the exit (which waits for it, bounded). A round for a server the
client cannot reach builds nothing: the breaker the node shares says so before any pack is
made or any check started, and the next settled point tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from megacache_client.config import ClientConfig
from megacache_client.results import PublishResult, Track
from megacache_client.steps.publish import shipped, snapshot, upload
from megacache_client.steps.settle import Settler
from megacache_client.torch import megacache_io
from megacache_client.torch.precompile import verify as precompile_verify
from megacache_client.transport.client import Deadline, RemoteCache, breaker_for
from megacache_client.transport.nodecache import NodeCache

log = logging.getLogger("megacache")

PROBE_S = 2.0
"""How long a round waits for the server's health check before it builds anything."""


class Publisher:
    """One process's publish rounds for its session's tracks."""

    def __init__(self, config: ClientConfig, node: NodeCache, holder: str,
                 tracks: Callable[[], list[Track]], warn: Callable[[str], None],
                 no_track: Track) -> None:
        self.config = config
        self.no_track = no_track
        """Stands for the session's result before anything compiled through it."""
        self.node = node
        self.holder = holder
        """This process's name on a publish claim."""
        self.tracks = tracks
        self.warn = warn
        self.closed = False
        """The session is closing: the exit's round waits for a precompile check."""
        self.precompile_keys: dict[str, list[str]] | None = None
        """torch's precompile key of each compiled callable (None: precompile off)."""
        self.precompile_note = ""
        """Why this process's precompiled Dynamo output was not shipped ("" when it was)."""
        self.settler: Settler | None = None
        self._thread: threading.Thread | None = None
        self._round_lock = threading.Lock()
        """One round at a time (a settled point's, the exit's, SIGTERM's)."""
        self._lock = threading.RLock()
        """Reentrant: SIGTERM's handler may start a round on the main thread while that
        thread is in `start_round` (the exit's)."""
        self._rounds = 0
        self._settled_at: int | None = None
        """How many artifacts torch had recorded when a round last left no track lacking
        anything (None: no round has): the exit skips its round when it is still that."""
        self._verdicts_since = False
        """A precompile check has verified entries since the last round began."""
        self._step_hook: Any = None

    # -- who may publish ----------------------------------------------------------------
    def may_publish(self) -> bool:
        """Whether this process publishes at all; says why not on every track. Every rank
        of a job may: a rank whose run compiled nothing its entry lacks (data parallel
        ranks, after the first) uploads nothing, and one that compiled graphs of its own
        (a pipeline stage, a model-parallel shard) adds them (`steps/claims.py`)."""
        tracks = self.tracks()
        why = ""
        if not self.config.may_publish or not tracks:
            why = "publishing disabled or nothing compiled through megacache"
        for track in tracks if why else ():
            track.publish.reason = why
        self.no_track.publish.reason = why or self.no_track.publish.reason
        return not why

    def unreachable(self) -> str:
        """Why the server cannot be reached now ("" = it can): the node's breaker is open,
        or a health check (refused at once, or no answer within `PROBE_S`) fails and opens
        it. A round then builds nothing: no pack, no precompile check, no compression. The
        exit's round, the last, first waits (up to `PROBE_S`) out a breaker about to close:
        another thread's request (the run's events) may be the probe that closes it."""
        breaker = breaker_for(self.config.url, self.config.node_cache_dir,
                              self.config.breaker_reset_s)
        if self.closed:  # the last round: a probe of another thread may be under way
            waited = time.monotonic() + PROBE_S
            while breaker.is_open and time.monotonic() < waited \
                    and breaker.open_for() <= PROBE_S:
                time.sleep(0.05)
        if not breaker.is_open:
            deadline = Deadline(min(PROBE_S, self.config.load_deadline_s))
            with RemoteCache(self.config, breaker, deadline=deadline) as remote:
                if remote.reachable():
                    return ""
            breaker.trip()
        return "cache server unreachable: nothing built or sent (tried again later)"

    # -- rounds ---------------------------------------------------------------------------
    def start_round(self) -> None:
        """Run a round in a background thread (none while one is under way)."""
        with self._lock:
            busy = self._thread is not None and self._thread.is_alive()
            if not busy and self.may_publish():
                self._thread = threading.Thread(target=self.round, name="megacache-publish",
                                                daemon=True)
                self._thread.start()

    def join(self, timeout: float | None = None, *, warn: bool = True) -> None:
        """Wait for the round under way (at most `timeout`, default `publish_wait_s`)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        limit = self.config.publish_wait_s if timeout is None else timeout
        thread.join(limit)
        if thread.is_alive() and warn:
            self.warn(f"publish still running after {limit:.0f}s; leaving it")

    def idle(self, timeout: float) -> bool:
        """Wait until no round runs (at most `timeout` seconds); True when none does."""
        if not self._round_lock.acquire(timeout=timeout):
            return False
        self._round_lock.release()
        return True

    def round(self) -> bool:
        """One publish round: snapshot (torch's save is incremental; under Dynamo's compile
        lock), upload what the tracks' entries lack, remember what shipped. At most
        `max_publishes` per process. True when it reached the server or had nothing to
        send (False: a later settled point may try again)."""
        with self._round_lock:
            tracks = self.tracks()
            recorded = megacache_io.artifacts_recorded()
            if self._nothing_new(recorded):
                return True
            down = self.unreachable()
            if down:
                log.debug("megacache: publish round: %s", down)
                self._say(tracks, down)
                if self.closed:  # the last round: this run's compile is not published
                    self.warn("cache server unreachable at exit: this run's compile was not "
                              "published")
                return False
            self._verdicts_since = False
            if self._rounds >= self.config.max_publishes:
                self._say(tracks, f"publish rounds capped at {self.config.max_publishes}",
                          keep=True)
                return True
            try:
                # only the exit waits for a precompile check under way: a settled point
                # ships the rest of the compile now, the verified entries when they are
                snap, note = snapshot(self.precompile_keys, tracks, self.node,
                                      self.config.max_raw_bytes, wait_verify=self.closed,
                                      on_verdicts=self._after_verdicts)
            except Exception as exc:
                self.warn(f"could not snapshot cache artifacts: {type(exc).__name__}: {exc}")
                self._say(tracks, "snapshot failed")
                return False
            self.precompile_note = note or self.precompile_note
            if snap is None:
                self._settled_at = recorded
                return True
            self._rounds += 1
            try:
                done = upload(snap, self.config, self.node, tracks[0], self.holder)
                shipped(snap, done)
            except Exception as exc:
                self._say(snap.tracks, f"publish failed: {type(exc).__name__}: {exc}")
                self.warn(snap.tracks[0].publish.reason)
                return False
            self._settled_at = recorded if len(done) == len(snap.tracks) else None
            return True

    def _nothing_new(self, recorded: int) -> bool:
        """At the exit: torch has recorded nothing since a round left no track lacking
        anything, and no precompile check has verified or is checking entries since; so
        the exit's round would snapshot (serialise every artifact, scan the kernels) to
        find nothing to send. A warm new machine's exit skips that."""
        return (self.closed and recorded >= 0 and recorded == self._settled_at
                and not self._verdicts_since and not precompile_verify.under_way())

    def _after_verdicts(self) -> None:
        """A precompile check ended with entries verified: a round adds them (after the
        round under way; the exit's round waits for the check itself)."""
        self._verdicts_since = True
        self.join(warn=False)
        if not self.closed:
            self.start_round()

    @staticmethod
    def _say(tracks: list[Track], why: str, keep: bool = False) -> None:
        for track in tracks:
            track.publish.reason = (track.publish.reason or why) if keep else why

    # -- settled points -------------------------------------------------------------------
    def start_settling(self) -> None:
        """After the first step: run a round at each settled point, off the training loop
        (the optimizer step hook only counts and wakes the settler's thread)."""
        if self.closed or self.settler is not None or not self.config.publish_early \
                or not self.may_publish():
            return
        self.settler = Settler(megacache_io.artifacts_recorded, self.round,
                               max_rounds=self.config.max_publishes)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._step_hook = register_optimizer_step_post_hook(self.settler.step)
        except Exception as exc:  # no optimizer hook: settled by quiet time alone
            log.debug("megacache: no optimizer step hook: %s", exc)
        self.settler.start()

    def stop_settling(self) -> None:
        if self.settler is not None:
            self.settler.stop()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    @property
    def result(self) -> PublishResult:
        tracks = self.tracks()
        return tracks[0].publish if tracks else self.no_track.publish
