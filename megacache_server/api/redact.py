"""Keep secrets out of the logs, however a client spells them.

The dashboard accepts its token as `/?token=mc_…` (so a link can carry it); uvicorn's text
access log writes the whole request target, query included, so that token would sit in
every log file and pipeline the logs go to. A client may also spell it so that a plain
match misses it: `%5F` for `_`, the whole token %-encoded (once or several times),
`?tok%65n=`, an encoded `=` (`&token%3Dmc_…`), or a token where no one expects one (the
path, `X-Request-ID`, a report's `detail` that a warning quotes). So a text is decoded
(repeatedly, until decoding changes nothing) before it is matched, and when it holds a
secret the decoded text is what is written, with the secret masked and control
characters escaped again (a decoded `%0A` must not forge a log line).

Every log line of the server passes `RedactTokens`: the handler of megacache's loggers
carries it (`logs.configure_logging`), and so do uvicorn's access and error loggers.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import quote, unquote

from megacache_client.wire.text import is_text

SECRET_PARAM = re.compile(r"((?:^|[?&;])\s*(?:token|access_token)\s*=)[^&;\s\"]*",
                          re.IGNORECASE)
BEARER = re.compile(r"mc[^A-Za-z0-9]?[0-9a-f]{16}[^A-Za-z0-9]?[A-Za-z0-9_-]{20,}",
                    re.IGNORECASE)
"""A megacache token anywhere in a string, whatever stands between its three parts (no
word boundary: `=mc_…` has none)."""
MAX_DECODES = 8
"""Rounds of %-decoding: a token encoded more often than this is not a usable token."""


def decoded(text: str) -> str:
    """`text` %-decoded until decoding changes nothing (at most MAX_DECODES rounds)."""
    for _ in range(MAX_DECODES):
        plain = unquote(text, errors="replace")
        if plain == text:
            break
        text = plain
    return text


def redact(text: str) -> str:
    """`text` unchanged when it holds no token, else decoded with every token masked."""
    plain = decoded(text)
    masked = BEARER.sub("mc_…redacted", SECRET_PARAM.sub(r"\1redacted", plain))
    if masked == plain:
        return text
    return "".join(_escaped(ch) for ch in masked)


def _escaped(ch: str) -> str:
    """`ch` %-escaped (its UTF-8) when a log line must not carry it raw: a control (a decoded
    `%0A` forges a line), and whatever else the text rule refuses (a decoded `%C2%85` or
    `%E2%80%A8` breaks a line for readers that split on them, `%E2%80%AE` reorders it)."""
    if " " <= ch != "\x7f" and is_text(ch):
        return ch
    return quote(ch, safe="", errors="surrogatepass")


class RedactTokens(logging.Filter):
    """Rewrites a record's message and arguments (uvicorn's access log passes the target as
    an argument and formats the arguments itself, so they stay arguments)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redacted(v) for k, v in record.args.items()}
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def _redacted(value: object) -> object:
    """A log argument with tokens masked: numbers stay numbers (`%d`), anything else is
    written as its redacted text (an exception's message may quote client input)."""
    if isinstance(value, (int, float)) or value is None:
        return value
    return redact(value if isinstance(value, str) else str(value))


def redact_access_log() -> None:
    """Install the filter on uvicorn's access and error loggers (once each)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
