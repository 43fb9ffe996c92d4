"""The blob GET job: N connections fetch the same blob in a loop (a job start: every rank
wants the same bundle), from ours, nginx and redis.

The load generator is here, not wrk: wrk reads 8 KiB per syscall and parses every byte,
so it saw ~2.3 GB/s from nginx at 16 readers where this one sees ~4.2. This one reads the
response head and then drops the body in the kernel (`recv(MSG_TRUNC)`: no copy to user
space), one process per core, so the client leaves the CPU to the server. Its own CPU use
is recorded (`client_cores`) next to the server's (`server_cores`) for every measurement.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from typing import Any

from benchmarks.harness.benchlib import LOOPBACK, MiB, log, ratio

from .fixtures import Blob, redis_set
from .measure import Bench, Tally, settle, summarize_runs
from .services import WORKERS, Service
from .wire import Protocol, connect, parse_head

REDIS_MAX_SIZE = 64 * MiB  # Redis is a reference for small values only
HEAD_READ = 64 * 1024
DROP_MAX = 64 * MiB


@dataclass(frozen=True)
class Load:
    """One request, sent again on each connection as soon as its previous answer is in."""

    port: int
    request: bytes
    protocol: Protocol = "http"


@dataclass
class _Conn:
    head: bytes = b""
    remaining: int | None = None  # body bytes still to drop; None while reading the head


def _fetch_worker(load: Load, conns: int, duration: float, barrier: Barrier,
                  out: mp.Queue) -> None:
    """One client process: `conns` keep-alive connections, each fetching in a loop.

    Bodies are dropped in the kernel with MSG_TRUNC into a scratch buffer that is never
    touched, so the client costs a syscall per socket-buffer-full, not a copy per byte.
    """
    try:
        sel = selectors.DefaultSelector()
        for _ in range(conns):
            sock = connect(load.port)
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, (sock, _Conn()))
    except OSError as exc:
        barrier.abort()
        out.put(f"connect to port {load.port}: {exc}")
        return
    scratch = bytearray(DROP_MAX)
    tally = Tally()
    barrier.wait()
    cpu0, t0 = time.process_time(), time.monotonic()
    deadline = t0 + duration
    for key in sel.get_map().values():
        key.data[0].send(load.request)
    while (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            sock, conn = key.data
            if conn.remaining is None:
                n = sock.recv_into(scratch, HEAD_READ)
                conn.head += scratch[:n]
                head = parse_head(load.protocol, conn.head, 200) if n else None
                if head is None:
                    if n == 0:  # the server hung up: count it, carry on with the others
                        tally.errors += 1
                        sel.unregister(sock)
                        sock.close()
                    continue
                head_len, body_len, ok = head
                tally.errors += not ok
                got = len(conn.head) - head_len
                conn.head, conn.remaining = b"", body_len - got
            else:
                got = sock.recv_into(scratch, min(conn.remaining, DROP_MAX), socket.MSG_TRUNC)
                if got == 0:
                    tally.errors += 1
                    sel.unregister(sock)
                    sock.close()
                    continue
                conn.remaining -= got
            tally.bytes += got
            if conn.remaining == 0:
                tally.responses += 1
                conn.remaining = None
                sock.send(load.request)
    tally.seconds = time.monotonic() - t0
    tally.client_cpu_s = time.process_time() - cpu0
    for key in list(sel.get_map().values()):
        key.data[0].close()
    out.put(tally)


def fetch(load: Load, readers: int, duration: float, server: Service) -> Tally:
    """`readers` connections fetching at once for `duration` s, from one process per core.

    The processes connect first and start together on a barrier, so connection set-up and
    process start-up are outside the measured window.
    """
    ctx = mp.get_context("fork")  # nothing to re-import; the parent holds no threads here
    procs = max(1, min(readers, os.cpu_count() or 1))
    barrier, out = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_fetch_worker, daemon=True,
                           args=(load, readers // procs + (i < readers % procs), duration,
                                 barrier, out)) for i in range(procs)]
    for w in workers:
        w.start()
    try:
        barrier.wait(timeout=60)
        cpu0 = server.cpu_seconds()
        results = [out.get(timeout=duration + 60) for _ in workers]
        server_cpu = server.cpu_seconds() - cpu0
    except Exception:
        for w in workers:
            w.kill()
        problems = []
        while not out.empty():
            problems.append(str(out.get()))
        raise RuntimeError(f"load generator failed: {'; '.join(problems) or 'timeout'}") \
            from None
    for w in workers:
        w.join()
    tallies = [r for r in results if isinstance(r, Tally)]
    return Tally(bytes=sum(t.bytes for t in tallies),
                 responses=sum(t.responses for t in tallies),
                 errors=sum(t.errors for t in tallies),
                 seconds=max(t.seconds for t in tallies),
                 client_cpu_s=sum(t.client_cpu_s for t in tallies),
                 server_cpu_s=server_cpu)


def blob_loads(blob: Blob, services: dict[str, Service]) -> dict[str, Load]:
    """The GET of `blob` from each target: ours by digest, nginx the very file our server
    stored, redis (values up to REDIS_MAX_SIZE, SET here first) by key."""
    loads = {
        "ours": Load(services["ours"].port,
                     f"GET /v1/cas/{blob.digest} HTTP/1.1\r\nHost: {LOOPBACK}\r\n\r\n"
                     .encode()),
        "nginx": Load(services["nginx"].port,
                      f"GET /cas/{blob.digest[:2]}/{blob.digest} HTTP/1.1\r\n"
                      f"Host: {LOOPBACK}\r\n\r\n".encode()),
    }
    if "redis" in services and blob.size <= REDIS_MAX_SIZE:
        redis_set(services["redis"].port, blob.digest, blob)
        loads["redis"] = Load(services["redis"].port,
                              f"*2\r\n$3\r\nGET\r\n$64\r\n{blob.digest}\r\n".encode(), "resp")
    return loads


def run_gets(bench: Bench, blobs: dict[int, Blob], readers: Sequence[int],
             services: dict[str, Service]) -> list[dict[str, Any]]:
    """Every (size, readers) against every target, repeats interleaved."""
    rows = []
    for size, blob in blobs.items():
        loads = blob_loads(blob, services)
        for name, load in loads.items():  # warm-up: imports, first-touch buffers, page cache
            fetch(load, WORKERS, min(1.0, bench.duration), services[name])
        for n in readers:
            runs: dict[str, list[Tally]] = {name: [] for name in loads}
            for r, name in bench.interleaved(list(loads)):
                tally = fetch(loads[name], n, bench.duration, services[name])
                runs[name].append(tally)
                log(f"GET {size // MiB:>4} MiB x{n:<3} {name:<5} repeat {r + 1}: "
                    f"{tally.mb_s:8.1f} MB/s ({tally.responses} responses, client "
                    f"{tally.client_cpu_s / tally.seconds:.2f} cores, {tally.describe()})")
                settle(services.values())
            row: dict[str, Any] = {"size": size, "size_mib": size // MiB, "readers": n}
            for name, tallies in runs.items():
                row[name] = summarize_runs(tallies)
            row["ratio"] = ratio(row["ours"]["mb_s"], row["nginx"]["mb_s"])
            row["ratio_runs"] = [ratio(a.mb_s, b.mb_s)
                                 for a, b in zip(runs["ours"], runs["nginx"], strict=True)]
            rows.append(row)
    return rows
