"""The client lifecycle inside a trainer: fingerprint → fetch → verify → load → publish → report.

`Session` holds the order of the steps and the rule over all of them: nothing the cache does
may hurt the trainer. Any failure is caught, logged as one clear warning, and the run
compiles cold; only `mode="required"` turns a failure into an exception. The load step has a
total deadline (`load_deadline_s`), so a server that accepts connections and never answers
costs seconds, not minutes. What each step does lives in `steps/`: `fetch.py` (find the
entry, fetch its blobs), `load.py` (place the packs, load into torch), `publish.py`
(snapshot, claim, upload, write the entries; with `shipping.py` and `claims.py`) and
`report.py` (the events); they raise, and the session decides what a failure costs.

Publishing and reporting do not wait for the exit: a process killed with SIGKILL runs no exit
handler. Right after the first compiled step the run's events go out, and each settled point
(`steps/settle.py`: the step after a compile completed) runs a publish round in the
background; the exit, and SIGTERM (`steps/preemption.py`), run a last one and report what
changed.

A process may compile several things (a model and its loss, a trainer and its EMA copy):
each distinct fingerprint is a `Track` with its own entry, load and publish. Torch keeps one
Mega-Cache per process, so every published entry carries the process's whole bundle: the
blobs are stored once (same bytes, same digest) and each key gets its own entry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

from megacache_client.config import ClientConfig
from megacache_client.job import JobIdentity
from megacache_client.results import LoadResult, MegacacheError, PublishResult, Snapshot, Track
from megacache_client.steps.claims import claim_holder
from megacache_client.steps.fetch import await_prefetch, failure_reason, fetch_blobs, find_entry
from megacache_client.steps.fingerprint import compute as compute_fingerprint
from megacache_client.steps.load import (
    await_toolchain,
    count_toolchain,
    load_bundle,
    place_artifacts,
    watch_kernel_keys,
)
from megacache_client.steps.nodecache import NodeCache
from megacache_client.steps.prefetch import Prefetcher
from megacache_client.steps.publish import shipped, snapshot, upload
from megacache_client.steps.report import (
    REPORT_DEADLINE_S,
    followups,
    send_events,
    send_finding,
    start_fields,
)
from megacache_client.steps.report import events as track_events
from megacache_client.steps.settle import Settler
from megacache_client.torch import env as torch_env
from megacache_client.torch import precompile, precompile_verify, start_clock, supported
from megacache_client.torch.packs import PackError
from megacache_client.transport.client import (
    CorruptBlobError,
    Deadline,
    DeadlineExceeded,
    RemoteCache,
)
from megacache_client.wire.events import Event, Outcome
from megacache_client.wire.manifest import Fingerprint

__all__ = ["LoadResult", "MegacacheError", "PublishResult", "Session", "Snapshot", "Track"]

log = logging.getLogger("megacache")


class Session:
    """One process's use of the cache: one track per distinct fingerprint it compiles."""

    def __init__(self, config: ClientConfig, *, model: str | None = None,
                 code: str | None = None, compile_options: dict[str, Any] | None = None,
                 fingerprint: Fingerprint | None = None) -> None:
        self.config = config
        self.model = model or config.model
        self.code = code or config.code
        self.compile_options = compile_options
        self.tracks: dict[str, Track] = {}
        self._fixed_fp = fingerprint
        self._no_track = Track(fingerprint or Fingerprint(model="none", code="none"),
                               LoadResult())
        self.node = NodeCache(config.node_cache_dir, config.lock_timeout_s)
        self._closed = False
        self._warned = False
        self._publisher: threading.Thread | None = None
        self._round_lock = threading.Lock()
        """One publish round at a time (a settled point's, the exit's, SIGTERM's)."""
        self._rounds = 0
        self._settled_at: int | None = None
        """How many artifacts torch had recorded when a round last left no track lacking
        anything (None: no round has): the exit skips its round when it is still that."""
        self._verdicts_since = False
        """A precompile check has verified entries since the last round began."""
        self.settler: Settler | None = None
        self._step_hook: Any = None
        self._report_lock = threading.Lock()
        self._sent: list[Event] | None = None
        """The events sent after the first step (None until they went out)."""
        self._reporter: threading.Thread | None = None
        """Sends the report of bad bytes this process met (one per process is enough)."""
        self._lock = threading.RLock()
        self.clock = start_clock.TimeToStart()
        self.prefetcher: Prefetcher | None = None
        self.precompile_off = ""
        """Why caching precompile is off in this process ("" when on)."""
        self.precompile_shared = ""
        """Why this process's precompiled Dynamo output was not shipped ("" when it was)."""
        self._precompile_keys: dict[str, list[str]] = {}
        """torch's precompile key of each compiled callable -> the callables wrapped under it."""
        self.job, self.job_note = JobIdentity.of_process(
            config.node_cache_dir if config.enabled and config.telemetry else None)
        """Which job, attempt and rank this process is (not in the fingerprint: job.py)."""
        self.holder = claim_holder()
        """This process's name on a publish claim: unique to it, meaningful in a log."""

    def start(self) -> Session:
        """Called when the client is enabled: precompile on, clock started, prefetch begun.

        Runs before the trainer's first torch.compile, so the prefetch thread overlaps the
        trainer's initialisation and torch records Dynamo's output from the first compile.
        """
        self.clock.mark_enabled()
        self.clock.on_first_step = self._first_step
        try:
            self.precompile_off = precompile.turn_on(self.config)
        except Exception as exc:
            self.precompile_off = f"could not turn precompile on: {exc}"
        if self.config.prefetch and self.prefetcher is None:
            self.prefetcher = Prefetcher(self.config, self.node).start()
        return self

    # -- the first track stands for the session (one model per process is the usual case)
    @property
    def _first(self) -> Track:
        return next(iter(self.tracks.values()), self._no_track)

    @property
    def fp(self) -> Fingerprint | None:
        return self._first.fp if self.tracks else None

    @property
    def load_result(self) -> LoadResult:
        return self._first.load

    @property
    def publish_result(self) -> PublishResult:
        return self._first.publish

    # -- entry points from the torch.compile hook ----------------------------------------
    def before_compile(self, target: Any, options: dict[str, Any]) -> None:
        """Called by the torch.compile hook: load each fingerprint once, before it compiles."""
        self.load(target, options)
        found = precompile.source_id(target)  # None when precompile is off or torch can't say
        if found is not None:
            self._precompile_keys.setdefault(found[0], []).append(found[1])

    def drop_precompiled(self, target: Any, exc: Exception) -> bool:
        """torch.compile(target) failed while a precompiled package for it is on local disk:
        remove the package (the hook then compiles again, as without one). False if there
        was none: the error is the trainer's own."""
        try:
            dropped = precompile.forget_package_of(target)
        except Exception:
            return False
        if dropped:  # the rest of the bundle still serves: a note in the event, no warning
            self.precompile_shared = self.precompile_shared or (
                f"a precompiled package failed to install ({type(exc).__name__}: {exc}); "
                "Dynamo traced as usual and its output is not shipped")[:500]
            log.info("megacache: %s", self.precompile_shared)
        return dropped

    def after_compile(self, compiled: Any) -> Any:
        """Called by the torch.compile hook with its result: time the first compiled step."""
        if not self.config.enabled or self.clock.first_step_end is not None:
            return compiled
        return start_clock.watch(compiled, self.clock)

    # -- steps 1-5: fingerprint, find, fetch and verify, place, load ---------------------
    def load(self, target: Any = None, options: dict[str, Any] | None = None) -> LoadResult:
        """Steps 1-5 for what is about to be compiled: fingerprint, find, fetch, place, load."""
        with self._lock:
            if not self.config.enabled or self._closed:
                return self.load_result
            result = LoadResult()
            started = time.monotonic()
            step = result.timer()
            try:
                fp = self.fingerprint(target, options)
            except Exception as exc:  # a model whose source cannot be read, ...
                if not self.tracks:
                    self._no_track.load = result
                self._fail(result, "error", supported.explain_api_error(exc)
                           if isinstance(exc, AttributeError) and "torch" in str(exc)
                           else f"fingerprint: {type(exc).__name__}: {exc}")
                return result
            result.key = fp.key()
            if result.key in self.tracks:
                return self.tracks[result.key].load
            self.tracks[result.key] = Track(fp, result)
            torch_env.set_job_id("megacache-" + result.key[:16])
            problem = watch_kernel_keys()
            if problem:
                self._warn(problem)
            step("fingerprint")
            try:
                prefetched = await_prefetch(self.prefetcher, self.config.prefetch_wait_s,
                                            result, self._warn)
                step("prefetch")
                cap = self.config.max_raw_bytes
                deadline = self._load_deadline()
                with RemoteCache(self.config, deadline=deadline) as remote:
                    found = find_entry(remote, fp, result, self.config.fallback, prefetched,
                                       self.job)
                    step("find")
                    if found is not None:
                        result.served = found
                        admitted = fetch_blobs(remote, self.config, self.node, found, result,
                                               prefetched)
                        result.bundle = admitted["megacache"]
                        step("fetch")
                        place_artifacts(admitted, result, cap, prefetched)
                        step("place")
                        load_bundle(admitted["megacache"], result, cap, prefetched)
                        step("load")
                        await_toolchain(self.prefetcher, result.entry, result,
                                        self.config.prefetch_wait_s, prefetched)
            except (CorruptBlobError, PackError) as exc:
                self._report_bad(exc, result)
                self._fail(result, "invalid", str(exc))
            except Exception as exc:  # never let the cache break the trainer
                self._fail(result, "error", failure_reason(self.prefetcher, exc))
            finally:
                result.seconds = time.monotonic() - started
                steps = result.steps
                self.clock.fetch_s = sum(steps.get(k, 0.0) for k in ("prefetch", "find", "fetch"))
                self.clock.load_s = sum(steps.get(k, 0.0)
                                        for k in ("fingerprint", "place", "load"))
            if result.outcome in ("hit", "fallback"):
                log.info("megacache: %s %s for %s in %.2fs (%s)", result.outcome,
                         (result.entry.key[:12] if result.entry else ""), fp.model,
                         result.seconds, result.reason)
            return result

    def _load_deadline(self) -> Deadline:
        """The load step's budget: the prefetch's, when the prefetch ran out of it (the
        server did not answer in time: a hung server costs a process one deadline, not one
        for the prefetch and another for the load); else a fresh one."""
        done = self.prefetcher.wait(0) if self.prefetcher is not None else None
        if self.prefetcher is not None and done is not None \
                and done.error.startswith(DeadlineExceeded.__name__):
            return self.prefetcher.deadline
        return Deadline(self.config.load_deadline_s)

    def fingerprint(self, target: Any = None, options: dict[str, Any] | None = None
                    ) -> Fingerprint:
        """The fingerprint of compiling `target` (names given by the user win)."""
        if self._fixed_fp is not None:
            return self._fixed_fp
        return compute_fingerprint(
            namespace=self.config.namespace, target=target,
            options=options if options is not None else self.compile_options,
            model=self.model, code=self.code)

    # -- step 6: publish what this run compiled ----------------------------------------
    def publish(self, wait: bool = False) -> PublishResult:
        """Run a publish round in a background thread (after any round under way).

        A round uploads only when this run has something its tracks' entries lack (and
        its earlier rounds did not ship), only from local rank 0, and never overwrites a
        newer entry (conditional PUT). The settled points run rounds on their own
        (`_first_step`); this is the exit's and the explicit caller's.
        """
        if self._reporter is not None:  # its verdict decides whether this run replaces
            self._reporter.join(REPORT_DEADLINE_S)  # the bad entry (usually long done)
        with self._lock:
            busy = self._publisher is not None and self._publisher.is_alive()
            if not busy and self._may_publish():
                self._publisher = threading.Thread(target=self._round, name="megacache-publish",
                                                   daemon=True)
                self._publisher.start()
        return self._join(wait)

    def _may_publish(self) -> bool:
        why = ""
        if not self.config.may_publish or not self.tracks:
            why = "publishing disabled or nothing compiled through megacache"
        elif os.environ.get("LOCAL_RANK", "0") != "0":
            why = "only local rank 0 publishes"
        for track in self.tracks.values() if why else ():
            track.publish.reason = why
        self._no_track.publish.reason = why or self._no_track.publish.reason
        return not why

    def _round(self) -> bool:
        """One publish round: snapshot (torch's save is incremental; under Dynamo's compile
        lock), upload what the tracks' entries lack, remember what shipped. One at a time;
        at most `max_publishes` per process. True when it reached the server or had
        nothing to send (False: a later settled point may try again)."""
        with self._round_lock:
            tracks = list(self.tracks.values())
            recorded = torch_env.artifacts_recorded()
            if self._nothing_new(recorded):
                return True
            self._verdicts_since = False
            if self._rounds >= self.config.max_publishes:
                for track in tracks:
                    track.publish.reason = track.publish.reason or (
                        f"publish rounds capped at {self.config.max_publishes}")
                return True
            try:
                keys = None if self.precompile_off else self._precompile_keys
                # only the exit waits for a precompile check under way: a settled point
                # ships the rest of the compile now, the verified entries when they are
                snap, note = snapshot(keys, tracks, self.node, self.config.max_raw_bytes,
                                      wait_verify=self._closed,
                                      on_verdicts=self._after_verdicts)
            except Exception as exc:
                self._warn(f"could not snapshot cache artifacts: {type(exc).__name__}: {exc}")
                for track in tracks:
                    track.publish.reason = "snapshot failed"
                return False
            self.precompile_shared = note or self.precompile_shared
            if snap is None:
                self._settled_at = recorded
                return True
            self._rounds += 1
            try:
                done = upload(snap, self.config, self.node, self._first, self.holder)
                shipped(snap, done)
            except Exception as exc:
                for track in snap.tracks:
                    track.publish.reason = f"publish failed: {type(exc).__name__}: {exc}"
                self._warn(snap.tracks[0].publish.reason)
                return False
            self._settled_at = recorded if len(done) == len(snap.tracks) else None
            return True

    def _nothing_new(self, recorded: int) -> bool:
        """At the exit: torch has recorded nothing since a round left no track lacking
        anything, and no precompile check has verified or is checking entries since; so
        the exit's round would snapshot (serialise every artifact, scan the kernels) to
        find nothing to send. A warm new machine's exit skips that."""
        return (self._closed and recorded >= 0 and recorded == self._settled_at
                and not self._verdicts_since and not precompile_verify.under_way())

    def _after_verdicts(self) -> None:
        """A precompile check ended with entries verified: a round adds them (after the
        round under way; the exit's round waits for the check itself)."""
        self._verdicts_since = True
        publisher = self._publisher
        if publisher is not None and publisher is not threading.current_thread():
            publisher.join(self.config.publish_wait_s)
        if not self._closed:
            self.publish()

    def _join(self, wait: bool, timeout: float | None = None) -> PublishResult:
        if wait and self._publisher is not None:
            limit = self.config.publish_wait_s if timeout is None else timeout
            self._publisher.join(limit)
            if self._publisher.is_alive() and timeout is None:
                self._warn(f"publish still running after {limit:.0f}s; leaving it")
        return self.publish_result

    # -- after the first step: report at once, publish at each settled point -------------
    def _first_step(self) -> None:
        """The first compiled step ended (`start_clock`): from a thread of its own, send
        the run's events (a process killed later has reported its start) and watch for
        settled points to publish at (`steps/settle.py`)."""
        threading.Thread(target=self._after_first_step, name="megacache-first-step",
                         daemon=True).start()

    def _after_first_step(self) -> None:
        self.report_start()
        with self._lock:
            if self._closed or self.settler is not None or not self.config.publish_early \
                    or not self._may_publish():
                return
            self.settler = Settler(torch_env.artifacts_recorded, self._round,
                                   max_rounds=self.config.max_publishes)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._step_hook = register_optimizer_step_post_hook(self.settler.step)
        except Exception as exc:  # no optimizer hook: settled by quiet time alone
            log.debug("megacache: no optimizer step hook: %s", exc)
        self.settler.start()

    def report_start(self) -> None:
        """Send the run's events now, once (the exit then sends only what changed)."""
        with self._report_lock:
            if self._sent is None and not self._closed:
                self._sent = send_events(self.config, self.events())

    # -- step 7: report -----------------------------------------------------------------
    def events(self) -> list[Event]:
        """One event per track; the process-wide figures go on the first one only."""
        return track_events(list(self.tracks.values()), self._start_fields, self._warn,
                            self.job)

    def event(self) -> Event | None:
        events = self.events()
        return events[0] if events else None

    def _start_fields(self) -> dict[str, Any]:
        """The event's time-to-start split and precompile fields."""
        note = self.precompile_off or self.precompile_shared or self.load_result.precompile
        return start_fields(self.clock, note)

    def report(self) -> Event | None:
        """POST this run's events (within the load deadline), or, when they went out after
        the first step, what changed since (`report.followups`); returns the run's first
        event as it stands now."""
        with self._report_lock:
            now = self.events()
            if self._sent is None:
                self._sent = send_events(self.config, now)
            elif now:
                send_events(self.config, followups(self._sent, now))
        return now[0] if now else None

    # -- the end -------------------------------------------------------------------------
    def retire(self) -> None:
        """Stop without publishing or reporting: another session took this one's place."""
        with self._lock:
            self._closed = True
        self._stop_settling()

    def close(self) -> Event | None:
        """Publish (bounded wait), report, and stop. Safe to call more than once."""
        with self._lock:
            if self._closed or not self.config.enabled:
                return None
            self._closed = True
        self._stop_settling()
        self.publish(wait=True)
        self._forget_precompiled()
        if self.tracks and self._first.load.entry is not None:
            count_toolchain(self.prefetcher, self._first.load, self.config.prefetch_wait_s)
        return self.report()

    def preempted(self, deadline: float) -> None:
        """SIGTERM (`steps/preemption.py`): by `deadline` (monotonic), finish the publish
        under way, or run one if a compile has finished and not shipped, and report the
        start if it has not gone out; what is not done by then is left."""
        if self._closed or not self.config.enabled:
            return
        if self.clock.first_step_end is not None or self.clock.forward_end is not None:
            threading.Thread(target=self.report_start, name="megacache-report",
                             daemon=True).start()
            self.publish()  # after the round under way, if any: only what it lacks
        self._join(True, max(0.0, deadline - time.monotonic()))

    def _stop_settling(self) -> None:
        if self.settler is not None:
            self.settler.stop()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _forget_precompiled(self) -> None:
        """Leave no precompiled entry on local disk for another process to load ungated."""
        if self.precompile_off or not precompile.enabled():
            return
        try:
            precompile.forget_local(k for kind, k in self.load_result.loaded_keys
                                    if kind == precompile.ARTIFACT_TYPE)
        except Exception as exc:
            log.debug("megacache: could not clear local precompiled entries: %s", exc)

    def _report_bad(self, exc: CorruptBlobError | PackError, result: LoadResult) -> None:
        """Tell the server which bytes were bad (in the background), so the fleet stops
        meeting them; an unsigned manifest or a refusal of our own names no blob."""
        finding = exc.finding
        if finding is None or self._reporter is not None:
            return
        if finding.entry_key is None and result.entry is not None:
            finding = dataclasses.replace(finding, entry_key=result.entry.key)
        self._reporter = send_finding(self.config, finding, self.job, result)

    # -- failure policy -----------------------------------------------------------------
    def _fail(self, result: LoadResult, outcome: Outcome, reason: str) -> None:
        result.outcome, result.reason = outcome, reason
        result.served = result.bundle = None
        self._warn(f"{outcome}: {reason}; compiling cold")
        if self.config.mode == "required":
            raise MegacacheError(f"megacache {outcome}: {reason}")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("megacache: %s", message)
        else:
            log.info("megacache: %s", message)
