"""A trainer whose compiles come in two waves, for the publish-rounds test
(tests/test_recovery.py). Zero-code (MEGACACHE_URL, MEGACACHE_MODEL in the environment).

It trains a compiled model on batches of one shape until the server has an entry for the
model (the first settled point's publish), then on batches of a second shape (torch compiles
again) until the entry changes or ROUNDS_WAIT seconds have passed, then exits. It prints the
entry's artifact counts as it saw them after each wave.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import torch  # noqa: F401  (the client enables itself right after this import)
from torch import nn


def entry(url: str, model: str) -> dict[str, int] | None:
    r = httpx.get(f"{url}/v1/ac", params={"model": model}, timeout=5)
    found = r.json()["entries"] if r.status_code == 200 else []
    return found[0]["artifact_counts"] if found else None


def train(compiled: nn.Module, opt: torch.optim.Optimizer, batch: int) -> None:
    compiled(torch.randn(batch, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    url, model_name = os.environ["MEGACACHE_URL"], os.environ["MEGACACHE_MODEL"]
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    deadline = time.monotonic() + 600  # a loaded CI machine compiles slowly
    while (counts := entry(url, model_name)) is None and time.monotonic() < deadline:
        train(compiled, opt, 4)
        time.sleep(0.05)
    seen["first"] = counts
    for _ in range(3):
        train(compiled, opt, 6)  # another static shape: torch compiles again
    until = time.monotonic() + float(os.environ.get("ROUNDS_WAIT", "30"))
    while time.monotonic() < until:  # until the second wave is published, or time is up
        train(compiled, opt, 6)
        time.sleep(0.05)
        if (counts := entry(url, model_name)) != seen["first"]:
            break
    seen["second"] = counts
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
