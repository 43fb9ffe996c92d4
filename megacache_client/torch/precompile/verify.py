"""The publisher's check of its precompiled Dynamo output, in a child process.

torch 2.13's precompiled Dynamo is experimental: an entry can name globals a new machine
lacks (Hugging Face ResNet's NameError), miss the guards torch could not save, or hold a
graph that does not compute what was traced. A default must not ship any of that, and a
static reading of the bytecode cannot tell all of it. So before an entry calls its
precompile artifacts verified, the publish thread hands them to a fresh interpreter
(`check.py`), which loads each as a new machine would and calls its graphs on
inputs of the traced shapes against the traced FX graph. Only artifacts that pass are
shipped, and the bundle's meta names them (`precompile.META_VERIFIED`); a consumer loads
no other.

It runs off the training loop and off the publish: a round that finds artifacts with no
verdict yet starts their check in a thread of its own and ships the rest of the compile at
once (the FX graphs, AOTAutograd entries and kernels a restart needs most), so a job
killed while the check runs (a few seconds: the child imports torch) has still left its
compile behind; when the verdicts arrive, `on_verdicts` runs a round that adds the
verified ones. Only the exit's round waits for a check under way. The check is bounded
(`TIMEOUT_S`): a crash, a timeout or a mismatch in the child leaves the artifact out,
logged once, and never reaches the trainer. A verdict is kept per artifact content, so a
later publish round does not check the same bytes again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megacache_client.torch import env as torch_env
from megacache_client.torch import megacache_io
from megacache_client.torch.precompile.patches import CAPTURED

log = logging.getLogger("megacache")

TIMEOUT_S = 180.0
"""The child's bound: importing torch and loading a model's graphs takes seconds; a child
stuck longer than this costs the entry its precompiled output, never the trainer."""

PROCESS_FAILED = "the check's process"
"""How a verdict begins when the check's process failed as a whole (a crash, a timeout on a
busy machine): no verdict on the artifact itself, unlike every other failure."""

_VERDICTS: dict[str, str] = {}
"""sha256 of an artifact's content -> why it is not verified ("" = verified)."""
_LOGGED: set[str] = set()
LAST_SECONDS = [0.0]
"""Wall time of this process's last child check (the cost of verification, measured)."""


@dataclass(frozen=True)
class Verdicts:
    """What a round may ship of its precompile artifacts."""

    failed: dict[str, str]
    """key -> why it failed the check (never shipped)."""
    pending: frozenset[str]
    """keys whose check is under way (shipped by a later round once verified)."""


_CHECKS: dict[str, threading.Event] = {}
"""sha256 of an artifact's content -> set when its check ended (a verdict is in _VERDICTS)."""
_CHECKS_LOCK = threading.Lock()


def under_way() -> bool:
    """Whether a check is running (its verdicts not in yet)."""
    with _CHECKS_LOCK:
        return bool(_CHECKS)


def verify(artifacts: megacache_io.Artifacts, kind: str) -> dict[str, str]:
    """Each artifact of type `kind` that failed the check: key -> why, waiting for the
    checks (the benchmark's and the exit's way)."""
    return check(artifacts, kind, wait=True).failed


def check(artifacts: megacache_io.Artifacts, kind: str, *, wait: bool,
          on_verdicts: Callable[[], None] | None = None) -> Verdicts:
    """Verdicts on the artifacts of type `kind`. Those without a verdict nor a check under
    way are checked together in one child process, in a thread of its own; a child that
    fails as a whole (crash, timeout) fails each of them. With `wait`, returns once every
    one has a verdict (within `TIMEOUT_S` more); otherwise at once, the unchecked ones
    pending, and `on_verdicts` is called when the check this call started has ended."""
    items = artifacts.get(kind, [])
    digests = {a.key: hashlib.sha256(a.content).hexdigest() for a in items}
    with _CHECKS_LOCK:
        todo = [a for a in items
                if digests[a.key] not in _VERDICTS and digests[a.key] not in _CHECKS]
        done = threading.Event()
        for a in todo:
            _CHECKS[digests[a.key]] = done
        running = {_CHECKS[d] for d in digests.values() if d not in _VERDICTS}
    if todo:
        threading.Thread(target=_check_in_background,
                         args=(todo, [digests[a.key] for a in todo], done, on_verdicts),
                         name="megacache-precompile-check", daemon=True).start()
    if wait:
        deadline = time.monotonic() + TIMEOUT_S + 5
        for event in running:
            event.wait(max(0.0, deadline - time.monotonic()))
    pending = frozenset(a.key for a in items if digests[a.key] not in _VERDICTS)
    failed = {a.key: _VERDICTS[digests[a.key]] for a in items
              if a.key not in pending and _VERDICTS[digests[a.key]]}
    for key, why in failed.items():
        if digests[key] not in _LOGGED:
            _LOGGED.add(digests[key])
            log.info("megacache: precompiled Dynamo entry %s not verified, not shipped "
                     "(new machines trace it): %s", key[:12], why)
    return Verdicts(failed, pending)


def settled(why: str) -> bool:
    """Whether a failed verdict is on the artifact itself (it does not load in a fresh
    process, names globals a new machine lacks, computes other values): the same trace
    fails the same way on any machine, so its producer's verdict can stand for everyone
    who traces it again. A check whose process failed settles nothing."""
    return bool(why) and not why.startswith(PROCESS_FAILED)


def _check_in_background(todo: list[Any], digests: list[str], done: threading.Event,
                         on_verdicts: Callable[[], None] | None) -> None:
    try:
        verdicts = _run_child(todo)
    except Exception as exc:  # never the trainer's problem: the artifacts stay out
        verdicts = {a.key: f"{PROCESS_FAILED} could not start: {type(exc).__name__}: {exc}"
                    for a in todo}
    with _CHECKS_LOCK:
        for a, digest in zip(todo, digests, strict=True):
            _VERDICTS[digest] = verdicts[a.key]
            _CHECKS.pop(digest, None)
    done.set()
    if on_verdicts is not None and any(not why for why in verdicts.values()):
        try:
            on_verdicts()
        except Exception as exc:
            log.debug("megacache: the round after the precompile check failed: %s", exc)


def _run_child(todo: list[Any]) -> dict[str, str]:
    """Verdicts of one child process over `todo` (every key has one)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="megacache-verify-") as tmp:
        job, out = Path(tmp) / "job.pkl", Path(tmp) / "verdicts.json"
        graphs = {bid: CAPTURED.get(bid) for a in todo for bid in _backend_ids(a.content)}
        job.write_bytes(pickle.dumps({"artifacts": [(a.key, a.content) for a in todo],
                                      "graphs": graphs}))
        why = ""
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "megacache_client.torch.precompile.check", str(job),
                 str(out)], capture_output=True, text=True, timeout=TIMEOUT_S,
                env=child_env(), cwd=tmp)
            if proc.returncode != 0:
                why = f"{PROCESS_FAILED} failed ({proc.returncode}): " + \
                    (proc.stderr.strip().splitlines() or [""])[-1][:300]
            else:
                verdicts = json.loads(out.read_text())
        except subprocess.TimeoutExpired:
            why = f"{PROCESS_FAILED} did not finish within {TIMEOUT_S:.0f} s"
        except (OSError, ValueError) as exc:
            why = f"{PROCESS_FAILED} could not run: {type(exc).__name__}: {exc}"
    LAST_SECONDS[0] = round(time.monotonic() - started, 3)
    if why:
        return {a.key: why for a in todo}
    return {a.key: str(verdicts.get(a.key, "the check gave no verdict")) for a in todo}


def _backend_ids(content: bytes) -> list[str]:
    """The compiled graphs a precompile artifact calls (unreadable: none; the child says)."""
    try:
        return [str(b) for b in pickle.loads(content).backends]
    except Exception:
        return []


def child_env() -> dict[str, str]:
    """This process's environment for the child, with the client switched off (the
    autoload hook must not enable it there) and torch's caches where this process has
    them, so the child finds the compiled kernels it would otherwise build again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    env["MEGACACHE_MODE"] = "off"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(torch_env.inductor_cache_dir())
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env
