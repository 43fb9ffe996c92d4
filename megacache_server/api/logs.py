"""The server's log lines: text shaped like uvicorn's, or one JSON object per line.

`configure_logging` is called by the CLI before uvicorn starts and by the app in each worker,
so the supervisor and the workers write the same format.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from megacache_client.wire.text import escape_foreign
from megacache_server.api.redact import RedactTokens, redact

TEXT_LOG_CAP = 8192
"""Characters of one text log message; a longer one is cut with a mark."""


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what log pipelines (Loki, ELK, Cloud Logging) ingest."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        data.update({key: redact(value) if isinstance(value, str) else value
                     for key, value in getattr(record, "fields", {}).items()})
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """uvicorn-shaped text lines whose message cannot forge another line: a message quotes
    client text (a report's detail, a path), so CR, LF, ESC and the other controls in it are
    escaped (`escape_foreign`). Tracebacks, which the server writes, stay as they are."""

    def __init__(self) -> None:
        super().__init__("%(levelname)-9s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = escape_foreign(record.message, TEXT_LOG_CAP)
        return super().formatMessage(record)


def configure_logging(log_format: str, level: str) -> None:
    """megacache's own loggers get a handler at `level` in either format (text lines shaped
    like uvicorn's); in JSON mode uvicorn's own loggers write JSON too. Every line the
    handler writes has its tokens masked (`redact`): warnings quote client input."""
    handler = logging.StreamHandler()
    handler.addFilter(RedactTokens())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
        names: tuple[str, ...] = ("megacache", "uvicorn", "uvicorn.error")
    else:
        handler.setFormatter(TextFormatter())
        names = ("megacache",)
    for name in names:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
        logger.setLevel(level.upper())
