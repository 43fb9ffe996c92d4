"""`megacache-server serve`: the service in the foreground, one worker or many.

Checks the storage first (nothing created on disk beside a dead index), hands the merged
settings to the worker processes through the environment, gives several workers one
Prometheus directory, and picks the header-bounding HTTP protocol where it can.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
from pathlib import Path

from megacache_client.wire.exitcodes import ExitCode
from megacache_server import __version__
from megacache_server.api import supervisor
from megacache_server.api.logs import configure_logging
from megacache_server.cli.runner import CommandFailed, configured, storage_problem
from megacache_server.settings import Settings

log = logging.getLogger("megacache.server")


def cmd_serve(args: argparse.Namespace) -> int:
    """`serve` (and the bare command): refused with CONFIG when the settings would expose
    the cache (`Settings.exposure_problem`), before anything is opened."""
    settings = configured(args)
    problem = settings.exposure_problem()
    if problem:
        raise CommandFailed(ExitCode.CONFIG, problem)
    return serve(settings)


def serve(settings: Settings) -> ExitCode:
    """Run the service in the foreground; the exit code says why it stopped."""
    from uvicorn.config import LOGGING_CONFIG

    configure_logging(settings.log_format, settings.log_level)
    problem = asyncio.run(storage_problem(settings))
    if problem:
        log.error("storage unavailable, not starting: %s", problem)
        return ExitCode.UNAVAILABLE
    _export(settings)
    own_metrics_dir = _metrics_dir(settings) if settings.workers > 1 else None
    log.info("megacache-server %s: http://%s:%s  data=%s  index=%s  workers=%s", __version__,
             settings.host, settings.port, settings.data_dir, settings.index_url(),
             settings.workers, extra={"fields": {
                 "event": "start", "version": __version__, "host": settings.host,
                 "port": settings.port, "data_dir": str(settings.data_dir),
                 "index": settings.index_url(), "workers": settings.workers}})
    json_logs = settings.log_format == "json"
    try:
        return supervisor.run(
            settings.workers, app="megacache_server.api.app:app_from_env", factory=True,
            host=settings.host, port=settings.port, log_level=settings.log_level,
            # JSON mode: our handlers (configure_logging) instead of uvicorn's text config
            log_config=None if json_logs else LOGGING_CONFIG,
            access_log=not json_logs,  # JSON mode logs requests itself
            timeout_keep_alive=settings.keepalive_timeout_s, timeout_graceful_shutdown=10,
            http=_http_protocol(),
            h11_max_incomplete_event_size=int(settings.max_header_size) + 16 * 1024)

    finally:
        if own_metrics_dir is not None:
            shutil.rmtree(own_metrics_dir, ignore_errors=True)


def _http_protocol() -> str:
    """Our header-bounding protocol (`api.connection_guard`) when httptools is installed;
    else h11, whose incomplete-event limit bounds header bytes while reading."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "megacache_server.api.connection_guard:BoundedHttpToolsProtocol"


def _metrics_dir(settings: Settings) -> Path | None:
    """Several workers share Prometheus counters through files in one directory.

    A PROMETHEUS_MULTIPROC_DIR the user set is used as it is and never emptied (it is
    theirs: it may hold anything). Otherwise the server makes its own under the data dir,
    empties it at start and removes it at exit, and returns it so the caller can.
    """
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        if any(path.glob("*.db")):
            log.warning("PROMETHEUS_MULTIPROC_DIR=%s holds files of an earlier run: counters "
                        "continue from them (empty it between runs)", path)
        return None
    path = settings.data_dir.resolve() / ".metrics" / str(settings.port)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return path


def _export(settings: Settings) -> None:
    """Hand the merged settings to uvicorn worker processes."""
    os.environ.update(settings.environment())
