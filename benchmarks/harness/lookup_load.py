"""Exact lookups back to back from a process of their own, until stdin closes.

scale_bench measures how long lookups wait while a scrape, a dashboard load or a GC runs.
Issued from a thread of the benchmark itself, each lookup would also wait for whatever that
process does meanwhile (its main thread polling the GC lock, its own garbage collector, the
GIL), and its tail would be the benchmark's, not the server's. Here the client is a small
process that does nothing else, as a trainer's lookups come from a process of their own.

    python benchmarks/harness/lookup_load.py URL KEYS_FILE OUT_FILE

KEYS_FILE holds one entry key per line. The process prints `ready` once its first lookup is
answered, then looks up keys at random until stdin is closed, and writes to OUT_FILE one
`start end status` line per lookup (`time.perf_counter()` seconds: CLOCK_MONOTONIC on Linux,
so the caller can compare them with its own clock).
"""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

import httpx


def main(url: str, keys_file: str, out_file: str) -> int:
    keys = Path(keys_file).read_text().split()
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    rng = random.Random(2)
    done: list[tuple[float, float, int]] = []
    from time import perf_counter

    with httpx.Client(base_url=url, timeout=120) as client:
        client.get(f"/v1/ac/{keys[0]}")
        print("ready", flush=True)
        while not stop.is_set():
            t = perf_counter()
            status = client.get(f"/v1/ac/{rng.choice(keys)}").status_code
            done.append((t, perf_counter(), status))
    Path(out_file).write_text("".join(f"{s!r} {e!r} {c}\n" for s, e, c in done))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
