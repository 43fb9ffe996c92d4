"""Keep secrets out of the access log.

The dashboard accepts its token as `/?token=mc_…` (so a link can carry it); uvicorn's text
access log writes the whole request target, query included, so that token would sit in
every log file and pipeline the logs go to. A client may also percent-encode the `=`
(`&token%3Dmc_…`) or put a token where no one expects one (the path, `X-Request-ID`): the
JSON log redacts every value it writes, and a megacache token is masked wherever it stands.
"""

from __future__ import annotations

import logging
import re

SECRET_PARAM = re.compile(
    r"((?:^|[?&;]|%26|%3B)(?:token|access_token)(?:=|%3D))(?:(?!%26|%3B)[^&;\s\"])*",
    re.IGNORECASE)
BEARER = re.compile(r"mc_[0-9a-f]{16}_[A-Za-z0-9_-]+")
"""A megacache token anywhere in a string (no word boundary: `%3Dmc_…` has none)."""


def redact(text: str) -> str:
    """`text` with token query values and anything shaped like a megacache token masked."""
    return BEARER.sub("mc_…redacted", SECRET_PARAM.sub(r"\1redacted", text))


class RedactTokens(logging.Filter):
    """Rewrites string arguments of each record (uvicorn passes the target as an argument)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (once)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactTokens) for f in logger.filters):
        logger.addFilter(RedactTokens())
