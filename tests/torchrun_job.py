"""One rank of a tiny DDP job (gloo, CPU) for the torchrun e2e test.

Enables megacache the way a user would (no model name or code), trains two steps of a tiny
DistributedDataParallel MLP under torch.compile, closes the session and writes what its rank
saw to $RESULT_DIR/rank<N>.json.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import megacache_client


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def train_step(compiled: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One step on this rank's own batch (seeded by rank and step: reruns see the same)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
    loss = compiled(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def main() -> nn.Module:
    session = megacache_client.enable()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TinyNet())
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        train_step(compiled, opt, rank, step)
    dist.barrier()
    session.close()
    lr, pr = session.load_result, session.publish_result
    result = {"rank": rank, "key": lr.key, "outcome": lr.outcome, "reason": lr.reason,
              "bytes_down": lr.bytes_down, "published": pr.published,
              "publish_reason": pr.reason, "model": session.fp.model if session.fp else None}
    Path(os.environ["RESULT_DIR"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return model  # kept alive by the caller: see below


if __name__ == "__main__":
    KEPT = main()
    # torch's gloo teardown can deadlock when the DDP Reducer is freed (its destructor,
    # holding the GIL, joins gloo's worker thread, which waits for the GIL): a warm rank
    # of this job hung for ten minutes in a loaded CI run. As tests/ett_torchrun_job.py:
    # the model is never freed; the exit handlers run, then the process ends.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
