"""A job attempt's life, kept on the node: when a killed attempt last lived, to the second.

A process killed with SIGKILL (an OOM kill, preemption without grace, a hung rank torchrun
gives up on) sends nothing more: the server can date its failure only by the last thing it
received, up to a heartbeat period (30 s) before the kill. That error lands in unsaved
training time and in time to recover. So rank 0 also renews a small file in the node cache
(`<node cache>/lifelines/<job>/attempt-<n>.json`: the time and the step) every
`LIFELINE_S`; a clean end removes it. When a later attempt of the job starts on the same
node (torchrun restarts there; so does a supervisor), it finds the files of the attempts
that never said they ended, and reports each one's last renewal as that attempt's last
sign of life (a heartbeat of that attempt): the failure is then dated within a second,
and named: `killed`, with what the node still shows of how (`postmortem.py`: a fatal
signal's dump, the container's OOM kills). A restart on another node (a fresh container)
finds nothing, and the heartbeat's precision stands (the server calls that failure `lost`).

Everything here is best effort and off the training loop: a file that cannot be written or
read costs a debug line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from megacache_client.ett import postmortem
from megacache_client.wire.progress import Cause

log = logging.getLogger("megacache")

LIFELINE_S = 0.5
"""How often rank 0 renews its attempt's file (a write of ~40 bytes)."""
MAX_AGE_S = 7 * 24 * 3600.0
"""Older files are another job's, long gone: removed unread."""


@dataclass(frozen=True)
class LastSign:
    """An earlier attempt's last renewal: alive at `at` with `step` optimizer steps done."""

    attempt: int
    at: float
    step: int
    cause: Cause = "killed"
    detail: str = postmortem.SILENT


class Lifeline:
    """One attempt's file on the node, and the files its job's earlier attempts left."""

    def __init__(self, node_dir: Path, job: str, attempt: int) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)[:128]
        self.dir = Path(node_dir) / "lifelines" / safe
        self.attempt = attempt
        self.path = self.dir / f"attempt-{attempt}.json"
        self.dump = postmortem.FatalDump(self.dir / f"attempt-{attempt}.fatal")
        self._renewed = False
        self._ended = False
        self._lock = threading.Lock()

    def renew(self, at: float, step: int) -> None:
        """This attempt is alive at `at`, `step` steps done (atomically: a kill mid-write
        leaves the previous renewal), the container's OOM kills so far beside it. Never
        after `end` (the heartbeat thread renewing while the attempt ends must not leave a
        file a later attempt would call a killed one's)."""
        with self._lock:
            if not self._ended:
                self._renew(at, step)

    def _renew(self, at: float, step: int) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not self._renewed:  # a trainer: a fatal signal leaves its stacks here
                self._renewed = True
                self.dump.enable()
            tmp = self.dir / f".{uuid.uuid4().hex}.tmp"
            tmp.write_text(json.dumps({"at": at, "step": step,
                                       "oom_kills": postmortem.oom_kills()}))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.debug("megacache: lifeline not renewed: %s", exc)

    def end(self) -> None:
        """The attempt said how it ended: nothing for a later one to report."""
        with self._lock:
            self._ended = True
        self.dump.remove()
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            log.debug("megacache: lifeline not removed: %s", exc)

    def orphans(self) -> list[LastSign]:
        """The last signs of the job's earlier attempts that never said they ended, oldest
        first; their files are removed (reported once)."""
        found: list[LastSign] = []
        try:
            paths = sorted(self.dir.glob("attempt-*.json"))
        except OSError:
            return found
        oom_now = postmortem.oom_kills()
        for path in paths:
            sign = _read(path)
            if sign is None or sign.attempt >= self.attempt:
                continue
            dump = path.with_suffix(".fatal")
            cause, detail = postmortem.verdict(dump if dump.exists() else None,
                                               _oom_kills(path), oom_now)
            try:
                path.unlink(missing_ok=True)
                dump.unlink(missing_ok=True)
            except OSError:
                continue
            if time.time() - sign.at <= MAX_AGE_S:
                found.append(LastSign(sign.attempt, sign.at, sign.step, cause, detail))
        return sorted(found, key=lambda s: s.attempt)


def _oom_kills(path: Path) -> int | None:
    try:
        value = json.loads(path.read_text()[:200]).get("oom_kills")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read(path: Path) -> LastSign | None:
    match = re.fullmatch(r"attempt-(\d{1,7})\.json", path.name)
    if match is None:
        return None
    try:
        data = json.loads(path.read_text()[:200])
        at, step = float(data["at"]), int(data["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not math.isfinite(at) or step < 0:
        return None
    return LastSign(int(match.group(1)), at, step)
