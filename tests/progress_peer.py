"""A recording peer on a loopback port: it keeps each job progress batch a client POSTs
(`POST /v1/jobs/{job}/progress`, checked against the wire contract) and answers 404 to
everything else, as a server with an empty cache would. A real socket server, for the
client's telemetry tests before (and besides) the real server's route."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megacache_client.wire.progress import ProgressBatch
from megacache_client.wire.schema import parse_json

PROGRESS = re.compile(r"^/v1/jobs/([^/?]+)/progress$")


NEWER = {"cause", "detail", "exit_code", "phases"}
"""What a server from before the failures' causes and the start's phases did not know (it
refused a batch holding any, or a `failure` record, with 422)."""


class ProgressPeer:
    def __init__(self, status: int = 202, older: bool = False) -> None:
        self.status = status
        self.older = older
        self.batches: list[tuple[str, dict[str, Any]]] = []
        """(job, the batch as sent), in arrival order."""
        self.invalid: list[str] = []
        self.lock = threading.Lock()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                found = PROGRESS.match(self.path)
                if found is None:
                    return self._answer(404, {"error": {"message": "not found"}})
                try:
                    parse_json(ProgressBatch, body)
                    if peer.older and any(NEWER & set(r) or r["kind"] == "failure"
                                          for r in json.loads(body)["records"]):
                        raise ValueError("unknown field (a server from before #60)")
                except Exception as exc:
                    with peer.lock:
                        peer.invalid.append(str(exc))
                    return self._answer(422, {"error": {"message": str(exc)}})
                with peer.lock:
                    peer.batches.append((found.group(1), json.loads(body)))
                self._answer(peer.status, {"accepted": True})

            def do_GET(self) -> None:  # noqa: N802
                self._answer(404, {"error": {"message": "not found"}})

            do_PUT = do_HEAD = do_DELETE = do_GET  # noqa: N815

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def records(self, job: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [r for j, b in self.batches if job in (None, j) for r in b["records"]]

    def kinds(self, job: str | None = None) -> list[str]:
        return [r["kind"] for r in self.records(job)]

    def wait_for(self, kind: str, timeout: float = 10.0, job: str | None = None) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if kind in self.kinds(job):
                return True
            time.sleep(0.02)
        return False


@contextlib.contextmanager
def recording(status: int = 202, older: bool = False) -> Iterator[ProgressPeer]:
    peer = ProgressPeer(status, older)
    peer._thread.start()
    try:
        yield peer
    finally:
        peer.server.shutdown()
        peer.server.server_close()
