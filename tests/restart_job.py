"""One rank of a torchrun job that fails once, for the restart test.

Enables megacache the way a user would (no model name or code) and trains two steps of a
tiny MLP under torch.compile. In attempt 0, rank 0 raises after its first step: its exit
still publishes what it compiled, and `--max-restarts 1` runs attempt 1. No process group:
the test is about the job's attempts at the cache, and gloo's own start-up on a loaded
2-core machine failed often enough to hide what the cache did. Each rank writes what it saw
to $RESULT_DIR/rank<N>-attempt<A>.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torchrun_job import TinyNet, train_step  # the same model as the other torchrun job

import megacache_client


def main() -> None:
    session = megacache_client.enable()
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = TinyNet()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        train_step(compiled, opt, rank, step)
        if step == 0:
            lr = session.load_result
            result = {"rank": rank, "attempt": attempt, "key": lr.key, "outcome": lr.outcome,
                      "reason": lr.reason}
            Path(os.environ["RESULT_DIR"], f"rank{rank}-attempt{attempt}.json").write_text(
                json.dumps(result))
            if attempt == 0 and rank == 0:
                raise RuntimeError("simulated failure after the first step of attempt 0")
    session.close()


if __name__ == "__main__":
    main()
