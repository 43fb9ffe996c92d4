"""Just enough HTTP/1.1 and RESP client for the load generators.

They frame responses themselves (head parsed, body length from the head) so the body can
be dropped unread, and send request bodies by sendfile, so the client spends as little CPU
as possible next to the server it measures.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from benchmarks.harness.benchlib import LOOPBACK

Protocol = Literal["http", "resp"]


class ProtocolError(Exception):
    """The server answered something the load generator cannot frame."""


def parse_head(protocol: Protocol, data: bytes, ok_status: int) -> tuple[int, int, bool] | None:
    """(head length, body length, ok) of the response starting `data`; None if incomplete.

    Only the head is parsed: the body length comes from Content-Length (HTTP) or the bulk
    string length (RESP), so the body itself can be discarded unread.
    """
    if protocol == "resp":
        end = data.find(b"\r\n")
        if end < 0:
            return None
        if data[:1] != b"$" or int(data[1:end]) < 0:
            raise ProtocolError(f"not a bulk string: {data[:80]!r}")
        return end + 2, int(data[1:end]) + 2, True  # + the trailing CRLF
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    status_line, *headers = data[:end].split(b"\r\n")
    length = None
    for line in headers:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise ProtocolError(f"no Content-Length: {data[:end]!r}")
    return end + 4, length, int(status_line.split(b" ", 2)[1]) == ok_status


def read_response(sock: socket.socket, protocol: Protocol, ok_status: int) -> bool:
    """Read one whole response from a blocking socket; whether it had the expected status."""
    data = b""
    while (head := parse_head(protocol, data, ok_status)) is None:
        chunk = sock.recv(65536)
        if not chunk:
            raise ProtocolError("connection closed mid-response")
        data += chunk
    head_len, body_len, ok = head
    left = head_len + body_len - len(data)
    while left > 0:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ProtocolError("connection closed mid-body")
        left -= len(chunk)
    return ok


def connect(port: int) -> socket.socket:
    """A blocking loopback connection with Nagle off (requests are small and must go now)."""
    sock = socket.create_connection((LOOPBACK, port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def put_head(path: str, length: int) -> bytes:
    """The head of a PUT whose body (sent separately, by sendfile) is `length` bytes."""
    return (f"PUT {path} HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n"
            ).encode()


def send_file(sock: socket.socket, head: bytes, path: Path, size: int, tail: bytes) -> None:
    """Send a request head, then the first `size` bytes of the file at `path` by sendfile
    (no copy through the client) and a short `tail` (e.g. what makes the body unique)."""
    sock.sendall(head)
    with open(path, "rb") as f:
        sock.sendfile(f, 0, size)
    if tail:
        sock.sendall(tail)
