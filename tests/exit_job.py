"""A trainer for the exit-path test (tests/test_exit_path.py). Zero-code (MEGACACHE_URL,
MEGACACHE_MODEL in the environment).

It counts the client's publish snapshots, apart by whether the session was closing, trains
a compiled model until a settled point's round has run (the entry exists and a snapshot
was taken), then, with NEW_SHAPE=1, compiles one more shape right before it exits (only the
exit's round can ship that). It prints the counts the exit's round leaves behind, from an
atexit hook registered before the client's (so it runs after the client's close)."""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any

from megacache_client import lifecycle, publisher

counts = {"early": 0, "exit": 0}
closing = {"now": False}
_snapshot, _close = publisher.snapshot, lifecycle.Session.close


def counted_snapshot(*args, **kwargs):  # type: ignore[no-untyped-def]
    counts["exit" if closing["now"] else "early"] += 1
    return _snapshot(*args, **kwargs)


def closing_close(self):  # type: ignore[no-untyped-def]
    closing["now"] = True
    return _close(self)


publisher.snapshot = counted_snapshot  # type: ignore[assignment]
lifecycle.Session.close = closing_close  # type: ignore[method-assign]
atexit.register(lambda: print(json.dumps(counts), flush=True))

import torch  # noqa: E402  (the client enables itself right after this import)
from torch import nn  # noqa: E402


def train(compiled: Any, opt: torch.optim.Optimizer, batch: int) -> None:
    compiled(torch.randn(batch, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    deadline = time.monotonic() + 600  # a loaded CI machine compiles slowly
    while counts["early"] == 0 and time.monotonic() < deadline:
        train(compiled, opt, 4)
        time.sleep(0.05)
    from megacache_client.torch import hook

    session = hook.active_session()  # the round that snapshot started ends (its upload)
    assert session is not None and session.publisher.idle(300), "a round never ended"
    if os.environ.get("NEW_SHAPE") == "1":
        train(compiled, opt, 6)  # another static shape: torch compiles again


if __name__ == "__main__":
    main()
