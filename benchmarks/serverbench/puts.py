"""The PUT job: uploaders store distinct blobs back to back, ours vs. nginx's DAV module.

Ours hashes (sha256), fsyncs and links each blob; nginx only writes and renames, so this is
a reference, not a goal.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.benchlib import MiB, log, ratio

from .fixtures import Blob
from .measure import Bench, Tally, settle, summarize_runs
from .services import Service
from .wire import connect, put_head, read_response, send_file


@dataclass(frozen=True)
class PutTarget:
    """Where uploads go: `path(digest)` is the URL path, `stored(digest)` the file it makes."""

    name: str
    port: int
    path: Callable[[str], str]
    stored: Callable[[str], Path]


def _upload_loop(target: PutTarget, blob: Blob, nonce: str, deadline: float,
                 max_uploads: int, tally: Tally, done: list[str], lock: threading.Lock
                 ) -> None:
    """One uploader: distinct blobs back to back on one keep-alive connection until the
    deadline. Each body is the fixture plus a short unique tail, so every PUT stores new bytes
    (a repeated digest would measure the already-stored path) and its digest costs only a
    copy of the fixture's hash state."""
    with connect(target.port) as sock:
        for i in range(max_uploads):
            if time.monotonic() >= deadline:
                break
            tail = f"{nonce}-{i}".encode()
            sha = blob.sha.copy()
            sha.update(tail)
            digest = sha.hexdigest()
            send_file(sock, put_head(target.path(digest), blob.size + len(tail)),
                      blob.path, blob.size, tail)
            ok = read_response(sock, "http", 201)
            with lock:
                tally.errors += not ok
                if ok:
                    tally.bytes += blob.size + len(tail)
                    tally.responses += 1
                    done.append(digest)


def upload(target: PutTarget, blob: Blob, uploaders: int, duration: float, max_uploads: int,
           server: Service) -> Tally:
    """`uploaders` clients PUTting distinct blobs for about `duration` s.

    Uploads in flight at the deadline are finished and counted; the window ends at the
    last one. Threads suffice: sendfile and recv release the GIL and nothing is hashed.
    What they stored is deleted and the page cache flushed afterwards, so writeback of
    one target's uploads does not slow the next measurement.
    """
    tally, done, lock = Tally(), list[str](), threading.Lock()
    cpu0, t0 = server.cpu_seconds(), time.monotonic()
    nonce = uuid.uuid4().hex[:8]
    threads = [threading.Thread(target=_upload_loop,
                                args=(target, blob, f"{nonce}-{u}", t0 + duration, max_uploads,
                                      tally, done, lock))
               for u in range(uploaders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally.seconds = time.monotonic() - t0
    tally.server_cpu_s = server.cpu_seconds() - cpu0
    for digest in done:
        target.stored(digest).unlink(missing_ok=True)
    os.sync()
    return tally


def put_targets(ours: Service, nginx: Service, data_dir: Path, nginx_prefix: Path
                ) -> dict[str, tuple[PutTarget, Service]]:
    """Ours (PUT /v1/cas/{digest}, stored under `data_dir`) and nginx DAV (PUT /put/...)."""
    return {
        "ours": (PutTarget("ours", ours.port, lambda d: f"/v1/cas/{d}",
                           lambda d: data_dir / "cas" / d[:2] / d), ours),
        "nginx": (PutTarget("nginx", nginx.port, lambda d: f"/put/{d}",
                            lambda d: nginx_prefix / "put" / d), nginx),
    }


def run_puts(bench: Bench, blob: Blob, uploaders: Sequence[int],
             targets: dict[str, tuple[PutTarget, Service]]) -> list[dict[str, Any]]:
    """PUT throughput per uploader count, ours vs. nginx DAV, repeats interleaved."""
    rows = []
    for n in uploaders:
        runs: dict[str, list[Tally]] = {name: [] for name in targets}
        for r, name in bench.interleaved(list(targets)):
            target, service = targets[name]
            tally = upload(target, blob, n, bench.put_duration, bench.max_uploads, service)
            runs[name].append(tally)
            log(f"PUT {blob.size // MiB:>4} MiB x{n:<3} {name:<5} repeat {r + 1}: "
                f"{tally.mb_s:8.1f} MB/s ({tally.responses} uploads in {tally.seconds:.1f}s, "
                f"{tally.describe()})")
            settle(service for _, service in targets.values())
        row: dict[str, Any] = {"size": blob.size, "size_mib": blob.size // MiB, "uploaders": n}
        for name, tallies in runs.items():
            row[name] = summarize_runs(tallies)
        row["ratio"] = ratio(row["ours"]["mb_s"], row["nginx"]["mb_s"])
        rows.append(row)
    return rows
