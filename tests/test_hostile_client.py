"""Every public call of the client against a hostile server or proxy: it drips, never ends,
lies about lengths, sends a decompression bomb, redirects elsewhere or never answers. The
trainer proceeds within its deadline plus one second, and its memory stays within 100 MiB.

The calls come from the code (`RemoteCache`'s public methods): a new call without a case
here fails `test_every_public_call_has_a_hostile_case`.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import make_fingerprint, make_manifest
from hostile_peer import FORGED, MODES, HostilePeer, hostile

from megacache_client.config import ClientConfig
from megacache_client.errors import Finding, TransportError
from megacache_client.transport.breaker import CircuitBreaker
from megacache_client.transport.client import RemoteCache
from megacache_client.transport.redirects import RedirectRefused
from megacache_client.transport.retry import Deadline
from megacache_client.transport.trust import ServedEntry

DEADLINE_S = 0.5
"""What one call may cost: below each timeout of `_config`, so the deadline is what ends a
call that the server drips or stalls (each of the ~80 cases waits it out)."""
SLACK_S = 1.0
MAX_GROWTH = 100 * 1024 * 1024
KEY = "a" * 64
DIGEST = "b" * 64

CALLS: dict[str, Callable[[RemoteCache, Path], Any]] = {
    "get_entry": lambda r, _: r.get_entry(KEY),
    "resolve_entry": lambda r, _: r.resolve_entry(KEY, job="j", attempt=0, ttl_s=60),
    "claim": lambda r, _: r.claim(KEY, holder="h", lease_s=60),
    "release_claim": lambda r, _: r.release_claim(KEY, holder="h"),
    "whoami": lambda r, _: r.whoami(),
    "reachable": lambda r, _: r.reachable(),
    "list_entries": lambda r, _: r.list_entries(model="mlp"),
    "put_entry": lambda r, _: r.put_entry(make_manifest({"megacache": b"x"},
                                                        make_fingerprint())),
    "has_blob": lambda r, _: r.has_blob(DIGEST),
    "upload_blob": lambda r, tmp: r.upload_blob(_file(tmp, b"y" * 3000), DIGEST),
    "download_blob": lambda r, tmp: r.download_blob(DIGEST, 3000, tmp / "blob"),
    "report": lambda r, _: r.report(Finding("digest", DIGEST, KEY, "bad")),
    "post_event": lambda r, _: r.post_event({"key": KEY, "model": "m", "outcome": "miss"}),
    "stats": lambda r, _: r.stats(),
    "post_progress": lambda r, _: r.post_progress(
        "j", b'{"attempt":0,"records":[{"kind":"heartbeat","at":1800000000.0,"step":1}]}'),
    "jobs": lambda r, _: r.jobs(),
    "job_ett": lambda r, _: r.job_ett("j"),
    "ett_trend": lambda r, _: r.ett_trend(days=30),
}
"""One call of each public method; what it returns must be harmless (below)."""


def _file(tmp: Path, data: bytes) -> Path:
    path = tmp / "upload"
    path.write_bytes(data)
    return path


def test_every_public_call_has_a_hostile_case() -> None:
    public = {name for name, _ in inspect.getmembers(RemoteCache, inspect.isfunction)
              if not name.startswith("_")} - {"close"}
    assert public == set(CALLS), f"calls without a hostile case: {public - set(CALLS)}"


def _config(url: str, tmp: Path) -> ClientConfig:
    return ClientConfig(url=url, token="mc_secret-token", read_timeout_s=0.8,
                        connect_timeout_s=0.5, retries=2, node_cache_dir=tmp / "node")


def _run(call: Callable[[RemoteCache, Path], Any], url: str, tmp: Path
         ) -> tuple[float, int, Any]:
    """Seconds taken, peak bytes allocated, and the result (or the exception raised)."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        with RemoteCache(_config(url, tmp), CircuitBreaker(), Deadline(DEADLINE_S)) as r:
            outcome: Any = call(r, tmp)
    except Exception as exc:
        outcome = exc
    finally:
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return elapsed, peak, outcome


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_hostile_server_costs_a_call_its_deadline_and_no_memory(
        name: str, mode: str, tmp_path: Path) -> None:
    with hostile(mode) as peer:
        elapsed, peak, outcome = _run(CALLS[name], peer.url, tmp_path)
    assert elapsed <= DEADLINE_S + SLACK_S, f"{name} took {elapsed:.1f}s against {mode}"
    assert peak < MAX_GROWTH, f"{name} allocated {peak / 2**20:.0f} MiB against {mode}"
    # nothing a hostile answer holds is taken for an entry, a listing or a blob
    assert not isinstance(outcome, ServedEntry | list | dict)
    if name in ("get_entry", "resolve_entry", "list_entries", "whoami", "stats", "jobs",
                "job_ett", "ett_trend", "download_blob") and mode != "drip_headers":
        assert isinstance(outcome, TransportError), (name, mode, outcome)
    assert not (tmp_path / "blob").exists()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_no_call_follows_a_redirect_the_server_did_not_vouch_for(name: str,
                                                                 tmp_path: Path) -> None:
    """A redirect to another port of this host is followed by no call, a blob download's
    included (it follows only the server's own origin or one the server announced:
    tests/test_redirects.py); the refusal comes before any connection is made there."""
    with hostile("silent") as elsewhere, hostile(f"redirect:{elsewhere.url}/x") as peer:
        elapsed, _, outcome = _run(CALLS[name], peer.url, tmp_path)
        peer.settle()
        elsewhere.settle()  # every connection the call made there has been read
        assert elapsed <= DEADLINE_S + SLACK_S
        followed = elsewhere.requests
    assert followed == [], f"{name} followed a redirect"
    if name == "download_blob":
        assert isinstance(outcome, RedirectRefused), outcome
        assert "did not announce" in str(outcome)
    elif name == "reachable":  # a health check sent elsewhere: no server here, not followed
        assert outcome is False, outcome
    elif name != "has_blob":  # a HEAD answer has no verdict to refuse; a 302 is no 200
        assert isinstance(outcome, TransportError | ValueError) or outcome in (None, "")
    assert peer.requests and "mc_secret-token" in peer.requests[0]


def test_a_redirect_loop_ends_within_the_deadline(tmp_path: Path) -> None:
    peer = HostilePeer("silent")
    peer.mode = f"redirect:{peer.url}/again"
    try:
        elapsed, _, outcome = _run(CALLS["download_blob"], peer.url, tmp_path)
    finally:
        peer.close()
    assert elapsed <= DEADLINE_S + SLACK_S and isinstance(outcome, TransportError)


@pytest.mark.parametrize("mode", ["drip", "endless", "short_length", "bomb"])
def test_the_load_step_gives_up_within_its_deadline_plus_a_second(mode: str,
                                                                   tmp_path: Path) -> None:
    """A trainer's load (the session, with its prefetch) against a hostile server: one
    warning, a cold compile, and the trainer goes on within the load deadline + 1 s."""
    from megacache_client.lifecycle import Session
    from megacache_client.torch import relocate

    relocate.recorder().install()  # torch's import, paid before the clock starts
    with hostile(mode) as peer:
        config = ClientConfig(url=peer.url, load_deadline_s=DEADLINE_S, read_timeout_s=30,
                              node_cache_dir=tmp_path / "node", model="mlp",
                              prefetch=True).validated()
        tracemalloc.start()
        started = time.monotonic()
        session = Session(config, fingerprint=make_fingerprint(model="mlp")).start()
        result = session.load()
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        session.retire()
    assert result.outcome == "error", result
    assert elapsed <= DEADLINE_S + SLACK_S, f"the load took {elapsed:.1f}s against {mode}"
    assert peak < MAX_GROWTH


TRAINER = """
from megacache_client.config import ClientConfig
from megacache_client.lifecycle import Session
from megacache_client.wire.manifest import Fingerprint
from megacache_client.wire.schema import parse

config = ClientConfig(url={url!r}, node_cache_dir={node!r}, prefetch=False,
                      load_deadline_s=5).validated()
session = Session(config, fingerprint=parse(Fingerprint, {fp!r})).start()
print(session.load().outcome)
session.retire()
"""


def test_a_servers_error_text_reaches_the_trainers_stderr_escaped(tmp_path: Path) -> None:
    """A server (or proxy) whose error message carries a newline, a forged
    `WARNING megacache:` line, ESC[2J and a CR: the trainer's stderr, at the default log
    level, shows the warning on one line with those characters escaped."""
    with hostile("forged") as peer:
        out = subprocess.run([sys.executable, "-c", TRAINER.format(
            fp=make_fingerprint().to_dict(), url=peer.url, node=str(tmp_path / "node"))],
            capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "error"
    assert "\x1b" not in out.stderr and "\r" not in out.stderr, repr(out.stderr)
    assert not [line for line in out.stderr.splitlines()
                if line.startswith(FORGED.split("\n")[1].split("\x1b")[0])], out.stderr
    assert "WARNING megacache: forged\\x1b[2J\\r" in out.stderr  # shown, escaped
