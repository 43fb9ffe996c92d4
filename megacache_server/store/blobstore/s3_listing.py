"""A lean parse of S3 ListObjectsV2 pages: the key and size of each object, nothing else.

fsck lists every blob. botocore parses each listed object through its generic shape model
and turns every LastModified into a datetime with dateutil: minutes of CPU at a million
objects; even ElementTree, building a tree of every object's eight fields to read two,
took a third of fsck's CPU at a million. Here each object is cut out of the page's bytes
with `bytes.find`, and only from a page whose shape is the plain one S3 and its
compatibles send (the S3 namespace on an unprefixed root, no CDATA or comments, the
closing tag present, every object with a Key and a numeric Size). botocore ≥ 1.36 emits
`before-parse` with a dict whose fields it merges into the parsed response; the hook fills
it and hands the generic parser an empty result. An older botocore never calls the hook
and parses the page its usual way: the same fields, only slower. Errors (status ≥ 300)
and any other body are left to botocore.
"""

from __future__ import annotations

import html
import re
from typing import Any

EVENT = "before-parse.s3.ListObjectsV2"
_S3_XMLNS = b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
_EMPTY = b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>'
_ROOT = re.compile(rb"\A\s*(?:<\?xml[^>]*\?>\s*)?<ListBucketResult(\s[^>]*)?>")
_COMMON_PREFIXES = re.compile(rb"<CommonPrefixes>.*?</CommonPrefixes>", re.S)
_TOP = {name: re.compile(rb"<%s(?:/>|>([^<]*)</%s>)" % (name.encode(), name.encode()))
        for name in ("NextContinuationToken", "ContinuationToken", "Prefix", "Name",
                     "IsTruncated", "EncodingType", "StartAfter")}
"""The page's own fields a paginator and botocore's after-call handlers read: with
EncodingType (botocore asks for `url`), `decode_list_object_v2` URL-decodes the keys."""


def register(client: Any) -> None:
    """Make `client`'s ListObjectsV2 pages carry only Key and Size per object.

    botocore also parses every S3 body once more, looking for an error sent with status 200
    (`_handle_200_error`, on `before-parse.s3.*`, run before any handler of the operation's
    own event): as much CPU again as reading the page. For ListObjectsV2 that check moves
    into `parse_page`, which runs it on any body it does not read itself; every other
    operation keeps it as it was."""
    events = client.meta.events
    events.register(EVENT, parse_page)
    check = _botocores_200_check()
    if check is not None:
        events.unregister("before-parse.s3.*", check)
        events.register_first("before-parse.s3.*", _unless_listing(check))


def _botocores_200_check() -> Any:
    """botocore's handler for errors sent with status 200, where this botocore has one."""
    import botocore.handlers

    return getattr(botocore.handlers, "_handle_200_error", None)


def _unless_listing(check: Any) -> Any:
    def handler(operation_model: Any, response_dict: dict[str, Any], **kwargs: Any) -> None:
        if getattr(operation_model, "name", None) != "ListObjectsV2":
            check(operation_model=operation_model, response_dict=response_dict, **kwargs)

    return handler


def parse_page(response_dict: dict[str, Any], customized_response_dict: dict[str, Any],
               **kwargs: Any) -> None:
    body = response_dict.get("body")
    if response_dict.get("status_code") != 200 or not isinstance(body, bytes | bytearray):
        return
    parsed = parse_listing(bytes(body))
    if parsed is None:  # not the plain shape: botocore checks it and parses it its own way
        check = _botocores_200_check()
        if check is not None and "operation_model" in kwargs:
            check(operation_model=kwargs["operation_model"], response_dict=response_dict)
        return
    customized_response_dict.update(parsed)
    response_dict["body"] = _EMPTY


def parse_listing(body: bytes) -> dict[str, Any] | None:
    """The page's objects (Key, Size) and what a paginator needs, or None when the body is
    not a complete, plain ListBucketResult (a truncated body must be retried, not read).
    Objects are cut out with `bytes.find`, a thousand to a page: a regular expression
    scanning for each object's end cost more than ElementTree's whole parse."""
    root = _ROOT.match(body)
    if root is None or _S3_XMLNS not in (root.group(1) or b"") \
            or not body.rstrip().endswith(b"</ListBucketResult>") \
            or b"<![CDATA[" in body or b"<!--" in body:
        return None
    head, *objects = body.split(b"<Contents>")
    contents, tail = [], b""
    for obj in objects:
        end = obj.find(b"</Contents>")
        key = _element(obj, b"Key", end)
        size = _element(obj, b"Size", end)
        if end < 0 or key is None or (size is not None and not size.strip().isdigit()):
            return None
        contents.append({"Key": _text(key), "Size": int(size) if size else 0})
        tail = obj[end:]
    rest = head + _COMMON_PREFIXES.sub(b"", tail)  # a CommonPrefixes' Prefix is not the page's
    parsed: dict[str, Any] = {"Contents": contents, "KeyCount": len(contents)}
    for name, pattern in _TOP.items():
        found = pattern.search(rest)
        if found is not None:
            parsed[name] = _text(found.group(1) or b"")
    parsed["IsTruncated"] = parsed.get("IsTruncated") == "true"
    return parsed


def _element(obj: bytes, tag: bytes, end: int) -> bytes | None:
    """The text of `<tag>` in `obj` before `end`, or None when it has none."""
    start = obj.find(b"<" + tag + b">", 0, end)
    if start < 0:
        return None
    start += len(tag) + 2
    stop = obj.find(b"</" + tag + b">", start, end)
    return obj[start:stop] if stop >= 0 else None


def _text(raw: bytes) -> str:
    """An element's text: UTF-8, with XML's character references resolved."""
    value = raw.decode()
    return html.unescape(value) if "&" in value else value
