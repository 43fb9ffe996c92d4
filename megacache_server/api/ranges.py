"""HTTP Range parsing for blob reads, so a broken download can resume where it stopped."""

from __future__ import annotations

import re

from megacache_server.errors import RangeNotSatisfiable

_SINGLE = re.compile(r"^bytes=(\d*)-(\d*)$")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The [start, end) span a `Range` header asks for, or None to send the whole blob.

    Multi-range and malformed headers are ignored (RFC 9110 §14.2 allows serving 200);
    a well-formed range that starts past the end raises 416.
    """
    if not header:
        return None
    match = _SINGLE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # suffix: the last N bytes
        length = _position(last, size)
        if length == 0:
            raise _unsatisfiable("empty suffix range", size)
        if size == 0:  # RFC 9110 §14.1.1: no byte of an empty blob can be selected
            raise _unsatisfiable("the blob is empty", size)
        return max(0, size - length), size
    start = _position(first, size)
    end = size if not last else min(_position(last, size) + 1, size)
    if last and _position(last, size) < start:
        return None
    if start >= size:
        raise _unsatisfiable(f"range starts at {start}, blob has {size} bytes", size)
    return start, end


def _position(digits: str, size: int) -> int:
    """A byte position as sent, or `size + 1` for one past any blob: a header of thousands
    of digits is a client's to send, and Python refuses to parse more than 4,300 of them."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else size + 1


def _unsatisfiable(message: str, size: int) -> RangeNotSatisfiable:
    return RangeNotSatisfiable(message, size=size, headers={"content-range": f"bytes */{size}"})
