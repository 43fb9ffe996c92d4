"""The report step: what each run saw, as events the server turns into stats.

One event per fingerprint the process compiled under. The process-wide figures (compile
seconds, seconds saved, bytes, the time-to-start split) go on the first track's event only,
so stats never count them twice. A bundle that loaded but served nothing is reported as
`inert`, not as a hit: torch found none of its graphs, so it saved nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from megacache_client.config import ClientConfig
from megacache_client.errors import Finding, exc_text
from megacache_client.job import JobIdentity
from megacache_client.results import LoadResult, Track
from megacache_client.torch import env as torch_env
from megacache_client.torch import precompile
from megacache_client.torch.start_clock import TimeToStart
from megacache_client.transport.client import Deadline, RemoteCache
from megacache_client.wire.events import Event, Outcome, Replay
from megacache_client.wire.text import as_text

log = logging.getLogger("megacache")

REPORT_DEADLINE_S = 5.0
"""A report of bad bytes gets this long, in its own thread, while the trainer compiles cold."""


def events(tracks: Sequence[Track], start_fields: Callable[[], dict[str, Any]],
           warn: Callable[[str], None], job: JobIdentity | None = None) -> list[Event]:
    """One event per track that got as far as an outcome; `start_fields` gives the first
    one its time-to-start and precompile fields; `warn` hears of an inert bundle. Each
    event of a job names it, so the server counts a job attempt once (its slowest rank)."""
    counters = torch_env.cache_counters() if tracks else {}
    compile_s = torch_env.compile_seconds() if tracks else 0.0
    out = []
    for n, track in enumerate(tracks):
        event = _event(track, counters, compile_s if n == 0 else None, start_fields, warn,
                       job_fields(job))
        if event is not None:
            out.append(event)
    return out


def job_fields(job: JobIdentity | None) -> dict[str, Any]:
    """What an event carries of the job: nothing outside one, rank and world size only
    when the launcher's pair makes sense."""
    if job is None or job.job_id is None:
        return {}
    fields: dict[str, Any] = {"job_id": job.job_id, "attempt": job.attempt}
    if job.rank < job.world_size:
        fields |= {"rank": job.rank, "world_size": job.world_size}
    return fields


def _event(track: Track, counters: dict[str, int], compile_s: float | None,
           start_fields: Callable[[], dict[str, Any]], warn: Callable[[str], None],
           job: dict[str, Any]) -> Event | None:
    res = track.load
    if res.key is None or res.outcome is None:
        return None
    outcome = res.outcome
    served = precompile.counters()["served"]
    if outcome in ("hit", "fallback") and counters["fxgraph_miss"] > 0 \
            and counters["fxgraph_hit"] + counters["aot_hit"] == 0 and served == 0:
        outcome = "inert"
        who = f"rank {job['rank']} of {job['world_size']}: " \
            if job.get("world_size", 1) > 1 else ""
        res.reason = (f"{who}bundle loaded but torch found none of its graphs: "
                      f"{counters['fxgraph_miss']} FX graph and {counters['aot_miss']} "
                      "AOTAutograd cache misses, no FX graph, AOTAutograd or precompiled "
                      "Dynamo hit")
        warn(res.reason)
    cold = res.entry.cold_compile_s if res.entry is not None else None
    saved = 0.0
    if compile_s is not None and cold is not None and outcome != "inert":
        saved = max(0.0, cold - compile_s)
    first = compile_s is not None
    return Event(
        key=res.key, model=track.fp.model, outcome=outcome, reason=as_text(res.reason, 2000),
        entry_key=res.entry.key if res.entry else None,
        differing=[as_text(d, 32) for d in res.differing[:8]],
        compile_s=round(compile_s or 0.0, 3), cold_compile_s=cold, saved_s=round(saved, 3),
        load_s=round(res.seconds, 3), bytes_down=res.bytes_down,
        bytes_up=track.publish.bytes_up, fxgraph_hit=counters["fxgraph_hit"] if first else 0,
        fxgraph_miss=counters["fxgraph_miss"] if first else 0,
        replay=replay(outcome, counters, served) if first else None,
        published=track.publish.published, **job,
        **(start_fields() if first else {}),
    )


def replay(outcome: Outcome, counters: dict[str, int], served: int) -> Replay:
    """Whether this process replayed the loaded entry's artifacts, from torch's own counters
    (`torch_env.cache_counters()`) and the calls precompiled Dynamo output served.

    A hit says a bundle loaded, not that torch used all of it: a graph the bundle lacks
    (another shape, code the producer never ran) is compiled as on a cold start, and the
    outcome alone hides that. So: `full` when the run loaded an entry and torch compiled
    nothing anew (no FX graph or AOTAutograd cache miss, at least one hit of those or of
    precompiled Dynamo); `partial` when it hit some and compiled others; `rebuilt` when no
    cache hit helped at all (miss, invalid, error, inert, or a hit nothing was found in).
    On GPU no autotuning is decided anew in a full replay either: the choices Inductor's
    autotuning made are part of the compiled graph the FX graph cache stores (the kernels'
    tuned configs travel in the same bundle), so an FX graph hit benchmarks nothing again.
    A precompiled Dynamo miss alone does not make a replay partial: Dynamo traces again,
    which compiles nothing when the graphs it traces hit the FX graph and AOTAutograd
    caches, the lookups counted here. Only the process's first event carries it (the
    counters are process-wide)."""
    if outcome not in ("hit", "fallback"):
        return "rebuilt"
    hits = counters["fxgraph_hit"] + counters["aot_hit"] + served
    if hits == 0:
        return "rebuilt"
    return "full" if counters["fxgraph_miss"] + counters["aot_miss"] == 0 else "partial"


def start_fields(clock: TimeToStart, precompile_note: str) -> dict[str, Any]:
    """The event's time-to-start split and precompile fields."""
    return {**_precompile_fields(precompile_note), **clock.fields()}


def _precompile_fields(note: str) -> dict[str, Any]:
    """The event's precompile counters (torch's) and why it was not used, if it was not."""
    c = precompile.counters()
    return {"precompile_hit": c["hit"], "precompile_miss": c["miss"] + c["error"],
            "precompile_reason": as_text(note, 500)}


def send_events(config: ClientConfig, events: list[Event]) -> list[Event] | None:
    """POST `events` (within the load deadline); the events sent, None when they could not
    be (a server that cannot take them costs a debug line, never the trainer)."""
    if not events:
        return None
    try:
        with RemoteCache(config, deadline=Deadline(config.load_deadline_s)) as remote:
            for event in events:
                remote.post_event(event.to_dict())
        return events
    except Exception as exc:
        log.debug("megacache: could not report the run's events: %s", exc)
        return None


FOLLOWUP_COUNTS = ("compile_s", "bytes_down", "bytes_up", "fxgraph_hit", "fxgraph_miss")
"""What a process's exit adds to the events it sent after its first step: compile seconds
and bytes since, cache lookups since (a later compile), and whether it published."""


def followups(sent: list[Event], now: list[Event]) -> list[Event]:
    """The exit's report when the run's events went out after its first step: per track,
    what changed since (`Event.followup`: counts no new run, outcome or time to start); a
    track that compiled only later gets its whole event; nothing for a track unchanged."""
    first = {e.key: e for e in sent}
    out = []
    for event in now:
        was = first.get(event.key)
        if was is None:
            out.append(event)
            continue
        more = {name: getattr(event, name) - getattr(was, name) for name in FOLLOWUP_COUNTS}
        more = {name: round(max(v, 0), 3) if name == "compile_s" else max(int(v), 0)
                for name, v in more.items()}
        if not any(more.values()) and event.published == was.published:
            continue
        out.append(Event(key=event.key, model=event.model, outcome=was.outcome,
                         reason=event.reason, entry_key=event.entry_key, followup=True,
                         published=event.published, job_id=event.job_id,
                         attempt=event.attempt, rank=event.rank, world_size=event.world_size,
                         **more))
    return out


def send_finding(config: ClientConfig, finding: Finding, job: JobIdentity | None,
                 result: LoadResult) -> threading.Thread:
    """Report bad bytes this load met, in a background thread (the cold compile does not
    wait for it); `result.reported` gets the server's verdict. The server re-verifies the
    blob from its own store, so a report about bytes a proxy broke on the way changes
    nothing there."""

    def send() -> None:
        deadline = Deadline(min(REPORT_DEADLINE_S, config.load_deadline_s))
        try:
            with RemoteCache(config, deadline=deadline) as remote:
                result.reported = remote.report(finding, job.job_id if job else None)
            log.info("megacache: reported %s of %s to the server: %s", finding.kind,
                     (finding.digest or finding.entry_key or "")[:12], result.reported)
        except Exception as exc:
            result.reported = f"not reported: {exc_text(exc)}"[:300]
            log.debug("megacache: %s", result.reported)

    thread = threading.Thread(target=send, name="megacache-report", daemon=True)
    thread.start()
    return thread
