"""A circuit breaker whose state the ranks of a node share through a small file.

Closed → open after `threshold` consecutive failures (or at once when a step ran out of
time, or the server asked us to come back later); half-open after the open period, when one
attempt may go through. Eight ranks on a node that each had to find out on their own that
the server hangs would each pay the load deadline; with the state in the node-local cache
dir, the first rank that finds out opens the breaker for all of them.

The file is advisory: it is written atomically (temp + rename) and read on each check. Two
ranks racing may lose a failure count, never corrupt the state; an unreadable or unwritable
file degrades to the per-process state, never to an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from pathlib import Path

from megacache_client.errors import CircuitOpenError

DEFAULT_THRESHOLD = 3
DEFAULT_RESET_S = 30.0


class CircuitBreaker:
    """Breaker state in memory, mirrored to `state_file` when one is given."""

    def __init__(self, threshold: int = DEFAULT_THRESHOLD, reset_s: float = DEFAULT_RESET_S,
                 state_file: Path | None = None) -> None:
        self.threshold = threshold
        self.reset_s = reset_s
        self.state_file = state_file
        self._failures = 0
        self._open_until = 0.0  # wall-clock time, so other processes can read it
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise CircuitOpenError while the breaker is open; else let the call through."""
        with self._lock:
            self._load()
            if not self._open_until:
                return
            left = self._open_until - time.time()
            if left <= 0:
                # half-open: this caller is the one probe; the node's other ranks keep
                # seeing the breaker open until the probe's success() closes it
                self._failures = self.threshold - 1
                self._open_until = time.time() + self.reset_s
                self._save()
                return
            raise CircuitOpenError(
                f"server marked down after repeated failures; not calling it for {left:.0f}s"
            )

    def success(self) -> None:
        with self._lock:
            self._load()
            if self._failures or self._open_until:
                self._failures, self._open_until = 0, 0.0
                self._save()

    def failure(self) -> None:
        with self._lock:
            self._load()
            self._failures += 1
            if self._failures >= self.threshold:
                self._open_until = time.time() + self.reset_s
            self._save()

    def trip(self, seconds: float | None = None) -> None:
        """Open now, for `seconds` (default: the reset period): the server is of no use."""
        with self._lock:
            self._failures = max(self._failures, self.threshold)
            self._open_until = max(self._open_until, time.time() + (seconds or self.reset_s))
            self._save()

    def open_for(self) -> float:
        """Seconds until the breaker lets a call through again (0 when it does now)."""
        with self._lock:
            self._load()
            return max(0.0, self._open_until - time.time())

    @property
    def is_open(self) -> bool:
        with self._lock:
            self._load()
            return self._open_until > time.time()

    def _load(self) -> None:
        if self.state_file is None:
            return
        try:
            state = json.loads(self.state_file.read_text())
            self._failures = int(state["failures"])
            self._open_until = float(state["open_until"])
        except FileNotFoundError:
            self._failures, self._open_until = 0, 0.0
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: keep what this process knows

    def _save(self) -> None:
        if self.state_file is None:
            return
        tmp = self.state_file.with_name(f".{self.state_file.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"failures": self._failures,
                                       "open_until": self._open_until}))
            os.replace(tmp, self.state_file)


_BREAKERS: dict[tuple[str, Path | None], CircuitBreaker] = {}
_BREAKERS_LOCK = threading.Lock()


def breaker_for(url: str, node_dir: Path | None = None,
                reset_s: float = DEFAULT_RESET_S) -> CircuitBreaker:
    """The breaker of one server, shared by every session and thread of this process and,
    through `node_dir/breaker/`, by every process on the node that uses the same dir."""
    state_file = None
    if node_dir is not None:
        name = hashlib.sha256(url.encode()).hexdigest()[:16]
        state_file = Path(node_dir) / "breaker" / f"{name}.json"
    with _BREAKERS_LOCK:
        breaker = _BREAKERS.setdefault((url, state_file), CircuitBreaker(state_file=state_file))
        breaker.reset_s = reset_s
        return breaker
