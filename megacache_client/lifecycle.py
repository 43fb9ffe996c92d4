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
import threading
import time
from typing import Any

from megacache_client.config import ClientConfig
from megacache_client.errors import MegacacheError
from megacache_client.job import JobIdentity
from megacache_client.publisher import Publisher
from megacache_client.results import LoadResult, PublishResult, Snapshot, Track
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
from megacache_client.steps.prefetch import Prefetcher
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
from megacache_client.torch import precompile, start_clock, supported
from megacache_client.torch.packs import PackError
from megacache_client.torch.precompile import store as dynamo_store
from megacache_client.transport.client import (
    CorruptBlobError,
    Deadline,
    DeadlineExceeded,
    RemoteCache,
)
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire.events import Event, Outcome
from megacache_client.wire.manifest import Fingerprint

__all__ = ["LoadResult", "PublishResult", "Session", "Snapshot", "Track"]

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
        self._retired = False
        """Another session took this one's place: it neither publishes nor reports."""
        self._warned = False
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
        self._precompile_keys: dict[str, list[str]] = {}
        """torch's precompile key of each compiled callable -> the callables wrapped under it."""
        self.job, self.job_note = JobIdentity.of_process(
            config.node_cache_dir if config.enabled and config.telemetry else None)
        """Which job, attempt and rank this process is (not in the fingerprint: job.py)."""
        self.publisher = Publisher(config, self.node, claim_holder(),
                                   lambda: list(self.tracks.values()), self._warn,
                                   self._no_track)

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
        if not self.precompile_off:
            self.publisher.precompile_keys = self._precompile_keys
            self._ignore_shared_precompiled()
        if self.config.prefetch and self.prefetcher is None:
            self.prefetcher = Prefetcher(self.config, self.node).start()
        return self

    def _ignore_shared_precompiled(self) -> None:
        """Say once that entries in torch's own Dynamo cache dir are not loaded here (this
        process reads only its own: `precompile/store.py`), e.g. ones an earlier client version
        or torch alone left behind."""
        try:
            found = dynamo_store.leftovers()
        except Exception:
            return
        if found:
            n = len(found)
            self._warn(f"{n} precompiled Dynamo entr{'y' if n == 1 else 'ies'} in "
                       f"{found[0].parent} ignored (torch would install them unchecked); "
                       "this process keeps its own apart")

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
            self.publisher.precompile_note = self.publisher.precompile_note or (
                f"a precompiled package failed to install ({type(exc).__name__}: {exc}); "
                "Dynamo traced as usual and its output is not shipped")[:500]
            log.info("megacache: %s", self.publisher.precompile_note)
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
    @property
    def settler(self) -> Settler | None:
        return self.publisher.settler

    def publish(self, wait: bool = False) -> PublishResult:
        """Run a publish round in the background (none while one is under way): it uploads
        only what this run has that its tracks' entries lack, and never overwrites a newer
        entry (conditional PUT). The settled points run rounds on their own; this is the
        exit's and the explicit caller's."""
        if self._reporter is not None:  # its verdict decides whether this run replaces
            self._reporter.join(REPORT_DEADLINE_S)  # the bad entry (usually long done)
        self.publisher.start_round()
        if wait:
            self.publisher.join()
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
            if not self._closed:
                self.publisher.start_settling()

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
        note = self.precompile_off or self.publisher.precompile_note \
            or self.load_result.precompile
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
            self._closed = self.publisher.closed = self._retired = True
        self.publisher.stop_settling()

    def close(self) -> Event | None:
        """Publish (bounded wait), report, and stop. Safe to call more than once."""
        with self._lock:
            if self._closed or not self.config.enabled:
                return None
            self._closed = self.publisher.closed = True
        self.publisher.stop_settling()
        self.publish(wait=True)
        if self.tracks and self._first.load.entry is not None:
            count_toolchain(self.prefetcher, self._first.load, self.config.prefetch_wait_s)
        return self.report()

    def preempted(self, deadline: float) -> None:
        """SIGTERM (`steps/preemption.py`): by `deadline` (monotonic), finish the publish
        under way, or run one if a compile has finished and not shipped, and report the
        start if it has not gone out; what is not done by then is left.

        The exit may be under way (`close`): a rank whose collective failed when a peer
        died raises, and its launcher's SIGTERM comes while the exit publishes. Handing the
        signal on at once would end that round; so it runs (or is started, when the exit
        has not got to it yet) and is waited for by the same deadline."""
        if self._retired or not self.config.enabled:
            return
        if self.clock.first_step_end is not None or self.clock.forward_end is not None:
            if not self._closed:  # the exit reports the start itself
                threading.Thread(target=self.report_start, name="megacache-report",
                                 daemon=True).start()
            self.publish()  # after the round under way, if any: only what it lacks
        self.publisher.join(max(0.0, deadline - time.monotonic()), warn=False)

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
