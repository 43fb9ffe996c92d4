"""A trainer that is stopped, for the recovery tests (tests/test_recovery.py). Zero-code:
MEGACACHE_URL and MEGACACHE_JOB_ID come from the environment; nothing here calls
megacache but the one-line checkpoint API (a trainer that checkpoints its own way).

MODE says how it is stopped; it writes $READY once it has trained, then waits:
- default: no SIGTERM handler of its own (Python's default: SIGTERM ends the process);
  with COMPILE=1 it trains a compiled model and is ready right after its first step (its
  compile not yet published: SIGTERM has to finish that);
- own: a SIGTERM handler of its own, installed before torch (and so megacache) is imported,
  as a framework's would be: it writes $MARKER and exits with code 3;
- stuck: its main thread sits in native code (a long key derivation, which never returns
  to the interpreter early) when SIGTERM comes, as a rank waiting on a dead peer does;
- crash: trains a compiled model one step, then raises, as a rank does whose collective
  failed when a peer died; its exit's publish round waits 2 s before it uploads and writes
  $READY at that point: the launcher's SIGTERM comes while the exit publishes;
- raise: trains one step (eager), then raises the same way; the POST that carries the
  attempt's end is held 1.5 s and writes $READY as it starts: the launcher's SIGTERM comes
  while the end is on its way;
- outage: saves a checkpoint every 0.5 s (SAVES of them; $READY after the third; the count
  so far in $SAVED after each), then ends; the test takes the server down and up meanwhile.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

MODE = os.environ["MODE"]
READY = Path(os.environ["READY"])


def own_handler(signum: int, frame: object) -> None:
    Path(os.environ["MARKER"]).write_text(str(time.time()))
    sys.exit(3)


if MODE == "own":
    signal.signal(signal.SIGTERM, own_handler)

import torch  # noqa: E402  (the client enables itself right after this import)

import megacache_client  # noqa: E402


def ready() -> None:
    READY.write_text(str(time.time()))


def slow_exit_upload() -> None:
    """The exit's upload, held 2 s (the only round: the job stops before a settled point)."""
    from megacache_client import publisher

    upload = publisher.upload

    def held(*args: object, **kwargs: object) -> object:
        ready()
        time.sleep(2.0)
        return upload(*args, **kwargs)  # type: ignore[arg-type]

    publisher.upload = held  # type: ignore[assignment]


def slow_end() -> None:
    """The POST carrying the attempt's end, held 1.5 s ($READY as it starts)."""
    from megacache_client.ett.sender import ProgressSender

    post = ProgressSender._post

    def held(self: ProgressSender, batch: object) -> str:
        if any(r.kind == "end" for r in batch.records):  # type: ignore[attr-defined]
            ready()
            time.sleep(1.5)
        return post(self, batch)  # type: ignore[arg-type]

    ProgressSender._post = held  # type: ignore[method-assign]


def main() -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model) if os.environ.get("COMPILE") == "1" or MODE == "crash" \
        else model
    for _ in range(3):
        run(torch.randn(4, 8)).sum().backward()
        opt.step()
        if MODE == "default" and os.environ.get("COMPILE") == "1":
            break  # ready right after the first step
        if MODE in ("crash", "raise"):
            (slow_exit_upload if MODE == "crash" else slow_end)()
            raise RuntimeError("Connection closed by peer (a peer rank died)")
    if MODE == "outage":
        for n in range(1, int(os.environ["SAVES"]) + 1):
            time.sleep(0.5)
            opt.step()
            megacache_client.checkpoint_saved(0.05)
            Path(os.environ["SAVED"]).write_text(str(n))
            if n == 3:
                ready()
        return
    ready()
    if MODE == "stuck":
        hashlib.pbkdf2_hmac("sha256", b"secret", b"salt", 200_000_000)
    time.sleep(120)


if __name__ == "__main__":
    main()
