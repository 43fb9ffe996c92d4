"""Running uvicorn so that start-up failures exit non-zero and workers die with their parent.

`uvicorn.run` exits 3 when its one worker fails to start but returns normally (exit 0) when
one of several workers does, and spawned workers outlive a supervisor killed with SIGKILL,
still answering on the port. Here both cases behave the same whatever --workers says.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from megacache_client.wire.exitcodes import ExitCode

log = logging.getLogger("megacache.server")

#: set by the supervisor for its workers: the pid whose death must end them
SUPERVISOR_ENV = "MEGACACHE_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1
#: the exit code of a uvicorn server whose start-up failed (uvicorn.config.STARTUP_FAILURE in
#: recent releases; older ones keep it elsewhere)
UVICORN_STARTUP_FAILURE = 3


def run(workers: int, **config: Any) -> ExitCode:
    """Serve until stopped; STARTUP if the service never started (or a worker could not)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    cfg = uvicorn.Config(workers=workers, **config)
    if workers == 1:
        server = uvicorn.Server(cfg)
        try:
            server.run()
        except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
            return ExitCode.STARTUP if exc.code else ExitCode.OK
        return ExitCode.OK if server.started else ExitCode.STARTUP
    try:
        sock = cfg.bind_socket()
    except SystemExit:
        return ExitCode.STARTUP
    os.environ[SUPERVISOR_ENV] = str(os.getpid())
    supervisor = Multiprocess(cfg, sockets=[sock])
    supervisor.run()
    failed = [p.pid for p in supervisor.processes if p.exitcode == UVICORN_STARTUP_FAILURE]
    if failed:
        log.error("worker(s) %s failed to start", failed)
        return ExitCode.STARTUP
    return ExitCode.OK


def exit_with_supervisor() -> None:
    """In a worker: stop (SIGTERM, a graceful uvicorn shutdown) when the supervisor dies.

    Linux delivers the signal itself (PR_SET_PDEATHSIG); elsewhere a thread polls the parent
    pid once a second. Not a worker of ours (one process, or run by someone else): nothing.
    """
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor or not supervisor.isdigit() or os.getpid() == int(supervisor):
        return
    parent = int(supervisor)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
                if os.getppid() != parent:  # it died before prctl took effect
                    os.kill(os.getpid(), signal.SIGTERM)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True,
                     name="megacache-supervisor-watch").start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
