"""Hostile text reaches a real server's log escaped, in both formats (#59: the escaping was
tested on the formatter only).

What a client chooses that the server writes to its log: the request target (uvicorn's
access log in text mode; the request record's `path` in JSON mode), `X-Request-ID` (JSON
mode), and a report's `detail` (quoted by the warning of a withdrawn entry). Wire text
refuses controls in a detail, but a %-encoded one is plain ASCII, and the log's token mask
(`api.redact`) %-decodes a text that holds a token before it masks it. So each carries a
%-encoded newline that would forge a log line, ESC (a terminal sequence), CR, a right-to-left
override, NEL, a line separator and a lone surrogate, next to a token; the log is read from
the server's own output and every line must be one printable line, the forged line nowhere
at the start of one, the token nowhere.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from helpers import ServerProcess, make_fingerprint, make_manifest, raw_http, sha256

from megacache_client.wire.text import is_text

TOKEN = "mc_0123456789abcdef_" + "S3cr3t" * 5
"""Shaped like a megacache token (the mask's pattern): what makes the log decode the text."""
FORGED = "FORGED-LINE megacache: all good"
HOSTILE = "%0D%0A" + FORGED.replace(" ", "%20") + "%1B[2J%E2%80%AE%C2%85%E2%80%A8%ED%A0%80"
"""CR LF, then a line of its own; ESC[2J, RLO, NEL, LS, a lone surrogate: all %-encoded."""


def settled_log(server: ServerProcess, done: Callable[[str], bool]) -> str:
    """The server's log once `done` holds (an access line is written after its response),
    read as the bytes it wrote: strict UTF-8, lines split at LF only."""
    deadline = time.monotonic() + 10
    while not done(server.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    raw = server.log_path.read_bytes()
    return raw.decode("utf-8")  # a lone surrogate written raw would not decode


def check_lines(log: str) -> list[str]:
    """Every line one printable line (no control, NEL, LS, bidi control or surrogate), the
    forged text never at the start of a line, the token masked."""
    lines = log.split("\n")
    for line in lines:
        assert is_text(line, cap=1 << 20), repr(line)
        assert not line.startswith("FORGED-LINE"), repr(line)
    assert TOKEN not in log and "S3cr3t" not in log
    return lines


def test_the_text_log_of_a_real_server_escapes_hostile_text(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data", log_level="info",
                           env={"MEGACACHE_WITHDRAW_AFTER_REPORTS": "1"}).start()
    try:
        data = b"bundle"
        manifest = make_manifest({"megacache": data}, make_fingerprint(model="esc"))
        with httpx.Client(base_url=server.url, timeout=10) as c:
            assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code in (200, 201)
            assert c.put(f"/v1/ac/{manifest.key}",
                         content=manifest.to_json()).status_code in (200, 201)
            # the access log: a target whose query holds a token and the hostile text
            r = c.get(f"/healthz?token={TOKEN}&probe={HOSTILE}")
            assert r.status_code == 200
            # a warning of megacache's own: the entry withdrawn, quoting the report's detail
            r = c.post(f"/v1/ac/{manifest.key}/report",
                       json={"kind": "load", "detail": f"{TOKEN}{HOSTILE}", "job": "j-1"})
            assert r.status_code == 200 and r.json()["verdict"] == "withdrawn", r.text
            # the same text raw is refused where the schema parses (nothing logged of it)
            raw = "x\r\nFORGED-LINE\x1b[2J\u202e\x85\u2028"
            r = c.post(f"/v1/ac/{manifest.key}/report", json={"kind": "load", "detail": raw})
            assert r.status_code == 422
        log = settled_log(server, lambda text: "probe=" in text and "withdrew entry" in text)
    finally:
        server.stop()
    lines = check_lines(log)
    access = [ln for ln in lines if "GET /healthz?token=redacted&probe=" in ln]
    assert len(access) == 1, log
    warning = [ln for ln in lines if "withdrew entry" in ln]
    assert len(warning) == 1, log
    for line in access + warning:  # shown, escaped, whole: the forged line is inside it
        assert "%0D%0AFORGED-LINE megacache: all good%1B[2J%E2%80%AE%C2%85%E2%80%A8" in line, line
    assert warning[0].startswith("WARNING   megacache.trust: withdrew entry"), warning[0]


def test_the_json_log_of_a_real_server_escapes_hostile_text(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data", "--log-format", "json", log_level="info").start()
    try:
        request = (f"GET /v1/ac/{HOSTILE}?token={TOKEN}&probe={HOSTILE} HTTP/1.1\r\n"
                   f"Host: 127.0.0.1\r\nX-Request-ID: ").encode() + \
            b"rid\x85\x9b[2J\r\nConnection: close\r\n\r\n"  # obs-text: NEL, CSI as latin-1
        status, _ = raw_http(server.port, request)
        assert status == 400  # malformed key: logged all the same
        log = settled_log(server, lambda text: '"status":400' in text)
    finally:
        server.stop()
    lines = check_lines(log)
    records = [json.loads(ln) for ln in lines if ln.startswith("{")]
    assert len(records) == sum(1 for ln in lines if ln.strip()), log  # no line but JSON
    (hit,) = [r for r in records if r.get("logger") == "megacache.access" and
              r.get("status") == 400]
    assert hit["request_id"] == "rid\x85\x9b[2J"  # the same text, escaped on the wire
    # the path uvicorn decoded, every character back as it was (the masked token aside)
    assert hit["path"].startswith("/v1/ac/\r\nFORGED-LINE megacache: all good\x1b[2J"
                                  "\u202e\x85\u2028"), hit
