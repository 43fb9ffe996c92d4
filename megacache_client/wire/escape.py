"""Text this code did not write, made safe to show: one helper for every log line, warning
and reason that carries a server's error body, a header, or a network exception's message.

A hostile server (or a proxy in front of it) chooses those bytes. Printed raw on a trainer's
stderr, a newline forges a log line of its own (`WARNING megacache: ...`), ESC starts a
terminal control sequence (`ESC[2J` clears the screen) and CR overwrites the line before it.
So every character the text rule refuses (controls, newlines, line and paragraph
separators, lone surrogates) is shown as its escape (`wire.text.escape_foreign`: `\\x1b`,
`\\r`, `\\u2028`), and the text is capped: what reaches a log is one line, of bounded length.
"""

from __future__ import annotations

import logging
import numbers

from megacache_client.wire.text import escape_foreign

CAP = 500
"""Characters of foreign text a message keeps (after escaping): enough for any real error."""


def escape(text: object, cap: int = CAP) -> str:
    """`text` (as `str()` makes it) on one printable line of at most `cap` characters plus
    an ellipsis: the text rule's `escape_foreign`, at the cap a log line keeps."""
    return escape_foreign(text, cap)


class EscapeForeign(logging.Filter):
    """A logging filter that escapes (`escape`) a record's message and every argument
    before any handler formats it, so no call site can print foreign text raw: the client's
    own words are printable already, and lose nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = escape(record.msg, 4 * CAP)
        if isinstance(record.args, tuple):
            record.args = tuple(a if isinstance(a, numbers.Number) else escape(a)
                                for a in record.args)  # numbers stay: `%d`, `%.2f`
        return True


def escape_logs(logger: logging.Logger) -> logging.Logger:
    """`logger` with `EscapeForeign` installed (once, however often this is called)."""
    if not any(isinstance(f, EscapeForeign) for f in logger.filters):
        logger.addFilter(EscapeForeign())
    return logger
