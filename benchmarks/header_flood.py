"""One connection sends a 150 MiB header line; what does it cost the server and the others?

    python -m benchmarks header_flood                   # the server of this checkout
    cd /tmp && PYTHONPATH=/other/checkout python /this/checkout/benchmarks/header_flood.py

(the second form measures another version: run it outside any checkout, since
`python -m megacache_server` puts the current directory first on the path).

Measures the bytes the attacker got out before the server cut it (kernel socket buffers
included), how long until the connection was answered or closed, the server's resident
memory before and at its peak, and the slowest `/healthz` another client saw meanwhile
(probed every 50 ms). Loopback only; bounded by the header size and a 300 s timeout.
Prints a table and writes JSON (default benchmarks/results/header_flood.json).
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import megacache_server
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LOOPBACK, LocalServer

ROOT = Path(__file__).resolve().parent


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def flood(port: int, size: int, pid: int) -> tuple[int, str, float, int]:
    """(bytes sent, first bytes of the answer or the error, seconds, peak RSS MiB)."""
    sent, peak, chunk = 0, rss_mib(pid), b"a" * (1 << 20)
    started = time.perf_counter()
    try:
        with socket.create_connection((LOOPBACK, port), timeout=300) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            while sent < size:
                s.sendall(chunk)
                sent += len(chunk)
                peak = max(peak, rss_mib(pid))
            s.sendall(b"\r\n\r\n")
            answer = s.recv(64).split(b"\r\n")[0].decode(errors="replace") or "closed"
    except OSError as exc:
        answer = type(exc).__name__
    return sent, answer, time.perf_counter() - started, max(peak, rss_mib(pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=150, help="header line size")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "header_flood.json")
    args = parser.parse_args(argv)
    server = LocalServer(Path(tempfile.mkdtemp(prefix="megacache-flood-")) / "data").start()
    assert server.proc is not None
    latencies: list[float] = []
    failures: list[str] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=300) as c:
            while not done.is_set():
                t = time.perf_counter()
                try:
                    if c.get(server.url + "/healthz").status_code != 200:
                        failures.append("status")
                except httpx.HTTPError as exc:
                    failures.append(type(exc).__name__)
                latencies.append(time.perf_counter() - t)
                time.sleep(0.05)

    try:
        before = rss_mib(server.proc.pid)
        prober = threading.Thread(target=probe)
        prober.start()
        sent, answer, seconds, peak = flood(server.port, args.mib << 20, server.proc.pid)
        time.sleep(1)
        done.set()
        prober.join()
    finally:
        server.stop()
    result = {"code": str(Path(megacache_server.__file__).parent), "header_mib": args.mib,
              "sent_mib": round(sent / (1 << 20), 1), "answer": answer,
              "seconds": round(seconds, 2), "rss_before_mib": before, "rss_peak_mib": peak,
              "healthz_max_ms": round(max(latencies, default=0) * 1000, 1),
              "probes": len(latencies), "probe_failures": failures}
    print(f"{'sent MiB':>9} {'seconds':>8} {'RSS MiB':>13} {'healthz max ms':>15}  answer")
    print(f"{result['sent_mib']:>9} {result['seconds']:>8} "
          f"{f'{before} -> {peak}':>13} {result['healthz_max_ms']:>15}  {answer}"
          f"{f'  ({len(failures)} failed probes)' if failures else ''}")
    write_record(make_record("header_flood", given_argv(argv), [result]), args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
