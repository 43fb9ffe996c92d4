"""One rank of a tiny DDP job (gloo, CPU) for the torchrun e2e test.

Enables megacache the way a user would (no model name or code), trains two steps of a tiny
DistributedDataParallel MLP under torch.compile, closes the session and writes what its rank
saw to $RESULT_DIR/rank<N>.json. With CRASH_IN_FIRST_ATTEMPT=1, rank 0 raises after the
first step of attempt 0 (its exit still publishes), so `--max-restarts 1` runs attempt 1.
"""

from __future__ import annotations

import json
import os
import time
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


def main() -> None:
    session = megacache_client.enable()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TinyNet())
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crash = os.environ.get("CRASH_IN_FIRST_ATTEMPT") == "1" and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        loss = compiled(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if crash and step == 0:
            dist.barrier()  # every rank has compiled: rank 0's exit publishes what they did
            if rank == 0:
                raise RuntimeError("simulated crash after the first step of attempt 0")
            time.sleep(600)  # the others wait, off the network, for the restart to stop them
    dist.barrier()
    session.close()
    lr, pr = session.load_result, session.publish_result
    result = {"rank": rank, "key": lr.key, "outcome": lr.outcome, "reason": lr.reason,
              "bytes_down": lr.bytes_down, "published": pr.published,
              "publish_reason": pr.reason, "model": session.fp.model if session.fp else None}
    Path(os.environ["RESULT_DIR"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
