"""A lean parse of S3 ListObjectsV2 pages: the key and size of each object, nothing else.

fsck lists every blob. botocore parses each listed object through its generic shape model
and turns every LastModified into a datetime with dateutil: minutes of CPU at a million
objects. The blob store needs two fields, which ElementTree reads
from the same bytes in a fraction of that. botocore ≥ 1.36 emits `before-parse` with a
dict whose fields it merges into the parsed response; the hook fills it and hands the
generic parser an empty result. An older botocore never calls the hook and parses the page
its usual way: the same fields, only slower. Errors (status ≥ 300) are never touched.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

EVENT = "before-parse.s3.ListObjectsV2"
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY = b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>'


def register(client: Any) -> None:
    """Make `client`'s ListObjectsV2 pages carry only Key and Size per object."""
    client.meta.events.register(EVENT, parse_page)


def parse_page(response_dict: dict[str, Any], customized_response_dict: dict[str, Any],
               **_: Any) -> None:
    if response_dict.get("status_code") != 200 or not response_dict.get("body"):
        return
    try:
        root = ET.fromstring(response_dict["body"])
    except ET.ParseError:
        return  # let botocore's own parser report what is wrong with it
    if root.tag != f"{_NS}ListBucketResult":
        return  # a store without the S3 namespace: the generic parser copes
    contents = []
    for obj in root.iter(f"{_NS}Contents"):
        key, size = obj.findtext(f"{_NS}Key"), obj.findtext(f"{_NS}Size")
        if key is not None:
            contents.append({"Key": key, "Size": int(size or 0)})
    parsed: dict[str, Any] = {"Contents": contents,
                              "IsTruncated": root.findtext(f"{_NS}IsTruncated") == "true",
                              "KeyCount": len(contents)}
    for name in ("NextContinuationToken", "ContinuationToken", "Prefix", "Name"):
        value = root.findtext(f"{_NS}{name}")
        if value is not None:
            parsed[name] = value
    customized_response_dict.update(parsed)
    response_dict["body"] = _EMPTY
