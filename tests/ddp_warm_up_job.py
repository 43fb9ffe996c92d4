"""DDP(torch.compile(model)) warmed up by `megacache_client.warm_up`, in a process of its own.

    python tests/ddp_warm_up_job.py STORE_FILE

tests/test_warm_up.py runs this as a child rather than in its own process: a DDP Reducer
freed in a test worker can deadlock it where no timeout reaches (gloo's teardown: the
Reducer's destructor, holding the GIL, joins gloo's worker thread, which waits for the GIL;
see tests/torchrun_job.py). A stop's CI waited 65 min on a stuck worker once. Here the
model is never freed; the process prints one JSON line of what the test checks, runs its
exit handlers and ends. The model and the compile count are the warm-up tests' own.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters


def model() -> nn.Module:
    """BatchNorm (buffers a forward changes) and Dropout (draws from the generator)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(),
                         nn.Linear(16, 2))


def compiles() -> int:
    """Dynamo frames compiled plus Inductor graphs built or loaded (forward and backward)."""
    return counters["frames"]["total"] + counters["inductor"]["fxgraph_cache_miss"] + \
        counters["inductor"]["fxgraph_cache_hit"]


def main(store: str) -> tuple[dict[str, Any], nn.Module]:
    """The facts the test asserts, and the DDP model (for the caller to keep alive)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import megacache_client

    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    net = model()
    ddp = DDP(torch.compile(net))
    handle = megacache_client.warm_up(ddp, torch.randn(4, 8))
    facts: dict[str, Any] = {"warmed": handle.wait(600) is not None, "error": handle.error,
                             "params": len(list(net.parameters())),
                             "grads_after_warm_up": sum(p.grad is not None
                                                        for p in net.parameters()),
                             "compiles_after_warm_up": compiles()}
    for _ in range(2):  # a reducer left expecting a backward would fail the second
        ddp(torch.randn(4, 8)).sum().backward()
    facts["compiles_after_steps"] = compiles()
    facts["grads_after_steps"] = sum(p.grad is not None for p in net.parameters())
    dist.destroy_process_group()
    return facts, ddp


if __name__ == "__main__":
    FACTS, KEPT = main(sys.argv[1])
    print(json.dumps(FACTS), flush=True)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
