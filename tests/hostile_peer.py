"""A hostile server (or proxy) on a loopback port: it reads each request's head, then
answers in one of the ways a trainer must survive (`MODES`), for every path alike.

It is a raw socket server, not http.server: the point is to send what a well-behaved HTTP
library never would (a length it does not keep, a body that never ends, headers one byte
at a time)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import zstandard

DRIP_EVERY_S = 0.25
BOMB_RAW = 256 * 1024 * 1024
"""What the bomb expands to: far over the 100 MiB a client may grow by."""


def _bomb() -> bytes:
    out = zstandard.ZstdCompressor(level=3).compressobj()
    zeros = bytes(4 * 1024 * 1024)
    parts = [out.compress(zeros) for _ in range(BOMB_RAW // len(zeros))]
    return b"".join(parts) + out.flush()


_BOMB: list[bytes] = []


def _head(status: str, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def drip(conn: socket.socket, _: str) -> None:
    """Declares 60 KB (inside every cap), then sends a byte every 0.25 s."""
    conn.sendall(_head("200 OK", {"content-type": "application/json",
                                  "content-length": "60000"}))
    while True:
        conn.sendall(b" ")
        time.sleep(DRIP_EVERY_S)


def drip_headers(conn: socket.socket, _: str) -> None:
    """A status line, then a header line every 0.25 s, forever."""
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while True:
        conn.sendall(b"x-more: 1\r\n")
        time.sleep(DRIP_EVERY_S)


def endless(conn: socket.socket, _: str) -> None:
    """A chunked body that never ends, as fast as the client reads."""
    conn.sendall(_head("200 OK", {"content-type": "application/json",
                                  "transfer-encoding": "chunked"}))
    chunk = b"[" * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    while True:
        conn.sendall(frame)


def huge_length(conn: socket.socket, _: str) -> None:
    """Declares a terabyte and sends bytes as fast as the client reads."""
    conn.sendall(_head("200 OK", {"content-type": "application/octet-stream",
                                  "content-length": str(10**12)}))
    chunk = b"\0" * 65536
    while True:
        conn.sendall(chunk)


def short_length(conn: socket.socket, _: str) -> None:
    """Declares 5,000 bytes, sends 100, and keeps the connection open in silence."""
    conn.sendall(_head("200 OK", {"content-type": "application/json",
                                  "content-length": "5000"}) + b"{" * 100)
    time.sleep(3600)


def bomb(conn: socket.socket, _: str) -> None:
    """256 MiB of zeros as a ~30 KiB zstd body, with Content-Encoding: zstd."""
    if not _BOMB:
        _BOMB.append(_bomb())
    conn.sendall(_head("200 OK", {"content-type": "application/json",
                                  "content-encoding": "zstd",
                                  "content-length": str(len(_BOMB[0]))}) + _BOMB[0])
    time.sleep(1)


FORGED = "no such key\nWARNING megacache: forged\x1b[2J\r"
"""An error message written to forge a log line, clear the screen and overwrite a line."""


def forged(conn: socket.socket, _: str) -> None:
    """A 403 whose error message (`FORGED`) carries a newline, a forged log line, an ESC
    sequence and a CR."""
    body = json.dumps({"error": {"code": "forbidden", "message": FORGED}}).encode()
    conn.sendall(_head("403 Forbidden", {"content-type": "application/json",
                                         "content-length": str(len(body))}) + body)


def silent(conn: socket.socket, _: str) -> None:
    """Accepts, reads the request, and never answers."""
    time.sleep(3600)


MODES: dict[str, Callable[[socket.socket, str], None]] = {
    "drip": drip, "drip_headers": drip_headers, "endless": endless,
    "huge_length": huge_length, "short_length": short_length, "bomb": bomb,
    "silent": silent, "forged": forged,
}


class HostilePeer:
    """Serves `mode` (a name of MODES, or "redirect:<url>", with `headers` besides the
    Location) to every request until closed. `requests` records each request's head as
    received (what the client sent)."""

    def __init__(self, mode: str, headers: dict[str, str] | None = None) -> None:
        self.mode = mode
        self.headers = headers or {}
        self.requests: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._counts = threading.Condition()
        self._accepted = self._read = 0
        self._marker = f"GET /settled-{uuid.uuid4().hex} "
        self._marked = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def settle(self, timeout: float = 10.0) -> None:
        """Return once every connection made to this peer before the call has had its head
        read, so `requests` holds all they sent (or will ever send): a marker connection
        queues behind them (connections are accepted in the order they were made), and
        the wait ends when it and every connection accepted so far have been read."""
        with socket.create_connection(self._sock.getsockname(), timeout=timeout) as marker:
            marker.sendall(f"{self._marker}HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            with self._counts:
                if not self._counts.wait_for(
                        lambda: self._marked and self._read == self._accepted, timeout):
                    raise TimeoutError(f"{self.url}: connections still unread")
                self._marked = False

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            with self._counts:
                self._accepted += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            head = ""
            try:
                head = _read_head(conn)
            finally:
                with self._counts:
                    self._read += 1
                    self._marked |= head.startswith(self._marker)
                    self._counts.notify_all()
            if head.startswith(self._marker):
                return
            self.requests.append(head)
            if self.mode.startswith("redirect:"):
                conn.sendall(_head("302 Found", {"location": self.mode[len("redirect:"):],
                                                 "content-length": "0", **self.headers}))
                return
            MODES[self.mode](conn, head)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


def _read_head(conn: socket.socket) -> str:
    conn.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        part = conn.recv(4096)
        if not part:
            break
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    text = head.decode("latin-1")
    length = next((int(line.split(":", 1)[1]) for line in text.split("\r\n")[1:]
                   if line.lower().startswith("content-length:")), 0)
    received = len(rest)
    while received < min(length, 1 << 20):  # the body of a small PUT or POST, read and dropped
        part = conn.recv(65536)
        if not part:
            break
        received += len(part)
    conn.settimeout(None)
    return text


@contextlib.contextmanager
def hostile(mode: str, headers: dict[str, str] | None = None) -> Iterator[HostilePeer]:
    peer = HostilePeer(mode, headers)
    try:
        yield peer
    finally:
        peer.close()
