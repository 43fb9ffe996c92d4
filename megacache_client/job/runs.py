"""The node's record of a job's last run: the attempt a launcher does not say.

Most launchers name the job and count its attempts (torchrun, SLURM: `job.py`). Where
none names the job (a plain `python train.py`), or one names it but keeps no count (a
Kubernetes pod restarted in place, Ray Train's worker group), a rerun after a failure
is still the next attempt of the same job, as the user sees it. So the node keeps, per
job (or, without a name, per command: the working directory and `sys.argv`), a small
record of its last run (`<node cache>/runs/<key>.json`: the job id, the attempt, the
process, how it ended):

- no record, or the last run finished (`sys.exit(0)`, the end of the script): a new job
  (unnamed: `<script>-<8 hex of the command>-<6 random>`), attempt 0;
- the last run failed, or never said (killed), and its process is gone: the same job,
  the next attempt;
- its process is still running (the same command started twice at once): a new job.

The record is written under a file lock when the process starts, and its end when rank
0's telemetry ends the attempt (`telemetry.py`). Best effort: a node cache that cannot be
written leaves the process without a job (as before), never stops it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger("megacache")

LOCK_S = 5.0
KEEP_S = 30 * 86400.0
"""Records of runs not started again for this long are removed (a new job starts a scan)."""


@dataclass(frozen=True)
class Run:
    """This process's place in its job, as the node's record gave it."""

    job_id: str
    attempt: int
    path: Path
    pid: int


def command_key(argv: Sequence[str] | None = None, cwd: str | None = None) -> str:
    """What makes two runs "the same command": the working directory and the arguments."""
    argv = list(sys.argv if argv is None else argv)
    cwd = os.getcwd() if cwd is None else cwd
    return hashlib.sha256(json.dumps([cwd, argv]).encode()).hexdigest()


def unnamed_job(argv: Sequence[str] | None = None, key: str | None = None) -> str:
    """A new job id for a command no launcher names: its script, its key, a random tail."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).stem if argv and argv[0] not in ("", "-c", "-m") else "python"
    if argv and argv[0] == "-m" and len(argv) > 1:
        script = argv[1]
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", script).strip("-._")[:40] or "python"
    return f"{stem}-{(key or command_key(argv))[:8]}-{secrets.token_hex(3)}"


def begin(runs_dir: Path, key: str, named: str | None,
          argv: Sequence[str] | None = None) -> Run | None:
    """This process's run of the job `named` (None: of the command `key`, `argv`): the
    next attempt after a run that did not finish, else attempt 0 of a new job (see the
    module). None when the node cache cannot hold the record."""
    path = Path(runs_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=LOCK_S):
            last = _read(path)
            ended = None if last is None else last.get("ended")
            if last is not None and (named is None or last.get("job") == named) and (
                    ended == "failed"
                    or ended is None and not _alive(last.get("pid"), last.get("ticks"))):
                job, attempt = str(last["job"]), int(str(last["attempt"])) + 1
            else:
                job, attempt = named or unnamed_job(argv, key), 0
            _write(path, {"job": job, "attempt": attempt, "pid": os.getpid(),
                          "ticks": _start_ticks(os.getpid()), "ended": None})
        if attempt == 0:
            _prune(path.parent)
    except (OSError, Timeout, ValueError, KeyError, TypeError) as exc:
        log.debug("megacache: no run record on the node: %s", exc)
        return None
    return Run(job, attempt, path, os.getpid())


def end(run: Run, reason: str) -> None:
    """The run ended: `finished` or `failed` (its next run is a new job, or its next
    attempt). Only the run's own process writes its end."""
    if os.getpid() != run.pid:
        return
    try:
        with FileLock(str(run.path) + ".lock", timeout=LOCK_S):
            last = _read(run.path)
            if last is None or last.get("pid") != run.pid or last.get("job") != run.job_id:
                return  # another run of the command took the record since
            _write(run.path, {**last, "ended": reason})
    except (OSError, Timeout, ValueError) as exc:
        log.debug("megacache: run record not ended: %s", exc)


def _prune(runs_dir: Path) -> None:
    """Records (and their locks) of commands not run for KEEP_S go: one per distinct
    command would otherwise pile up on a node for ever."""
    old = time.time() - KEEP_S
    try:
        for entry in os.scandir(runs_dir):
            if entry.is_file() and entry.stat().st_mtime < old:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    except OSError:
        return


def _read(path: Path) -> dict[str, object] | None:
    try:
        found = json.loads(path.read_text()[:4096])
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a torn or foreign file: as if none
    if not isinstance(found, dict) or not isinstance(found.get("job"), str) \
            or not isinstance(found.get("attempt"), int):
        return None
    return found


def _write(path: Path, record: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _stat(pid: int) -> tuple[str, int] | None:
    """The process's state and start time in clock ticks since boot (with the pid: which
    process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _start_ticks(pid: int) -> int | None:
    found = _stat(pid)
    return found[1] if found is not None else None


def _alive(pid: object, ticks: object) -> bool:
    """Whether the recorded process still runs (the same pid started at the same tick)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _stat(pid)
    if now is None:
        return True  # no /proc: the pid answered
    return now[0] not in ("Z", "X") and (ticks is None or now[1] == ticks)
