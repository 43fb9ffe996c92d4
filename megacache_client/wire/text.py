"""Names are text: the one rule for every name and free-text field on the wire.

A model name, job id, reason or detail is shown in views, logs and `/metrics` labels and
stored in an index that must encode it. A lone surrogate (what a JSON `\\ud800` escape or
a non-UTF-8 byte read with surrogateescape becomes) survives `json.loads` as a `str` but
breaks every encoder later; a CR, LF or ESC forges log lines or repaints a terminal. So
both sides check text with `check_text` where the schema parses, and anything shown that
this side did not write goes through `escape_foreign` (one helper for client and server).
"""

from __future__ import annotations

import unicodedata

TEXT_CAP = 1024
"""The longest name or free-text field the wire accepts, in characters."""

_BAD_CATEGORIES = frozenset({"Cc", "Cs", "Co", "Cn", "Zl", "Zp"})
"""Control (C0, C1, DEL), surrogate, private use, unassigned, line and paragraph separators."""
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Embeddings, overrides and isolates: a right-to-left override (U+202E) in a model name
or a fingerprint value reorders what a table shows after it (#58: `gpt-\u202eevil` reached
the CLI raw), so they are refused like controls and escaped where shown."""


def _bad(ch: str) -> bool:
    return (unicodedata.category(ch) in _BAD_CATEGORIES and ch != "\t") \
        or ch in BIDI_CONTROLS


def text_error(value: str, cap: int = TEXT_CAP) -> str | None:
    """Why `value` is not wire text (printable, no surrogates or controls, at most `cap`
    characters), or None. Tab is allowed: it forges nothing once escaped in logs."""
    if len(value) > cap:
        return f"String should have at most {cap} characters"
    for i, ch in enumerate(value):
        if _bad(ch):
            return (f"String should be printable text: character {i} is U+{ord(ch):04X}"
                    " (a control character, surrogate, bidi control or non-character)")
    return None


def is_text(value: object, cap: int = TEXT_CAP) -> bool:
    """Whether `value` is a str that follows the text rule."""
    return isinstance(value, str) and text_error(value, cap) is None


def check_text(value: str, cap: int = TEXT_CAP) -> str:
    """`value` unchanged if it is wire text; ValueError saying why otherwise."""
    why = text_error(value, cap)
    if why is not None:
        raise ValueError(why)
    return value


def escape_foreign(value: object, cap: int = TEXT_CAP) -> str:
    """`value` safe to print in one log line, label or view: every character the text rule
    refuses (and tab) becomes its Python escape (`\\n`, `\\r`, `\\x1b`, `\\ud800`), and the
    result is cut at `cap` characters with a mark. Idempotent: text escaped once (a reason)
    and again on its way to a log (the client's log filter) reads the same, so backslashes
    are left as they are. Never raises: for data stored by an older server, or an answer
    from a server we do not trust."""
    text = value if isinstance(value, str) else str(value)
    out: list[str] = []
    size = 0
    for ch in text:
        piece = ch.encode("unicode_escape").decode("ascii") if ch == "\t" or _bad(ch) else ch
        if size + len(piece) > cap:
            out.append("…")
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)



def as_text(value: str, cap: int = TEXT_CAP) -> str:
    """`value` if it is wire text within `cap`, else escaped (`escape_foreign`) to fit: what
    this side sends of text it did not choose (an exception's message may hold a newline),
    and what a view shows of text an older server stored before the rule (a lone surrogate
    would break the JSON answer; CR or ESC would reach a terminal)."""
    return value if is_text(value, cap) else escape_foreign(value, cap - 1)
