"""A gloo process group for the ranks of a torchrun attempt, shared by the job scripts."""

from __future__ import annotations

import os


def init_group() -> None:
    """The job's gloo group, its keys under this attempt's prefix: torchrun's agent keeps
    one store across restarts, and a rank of attempt N that reads a peer's address before
    the peer wrote it again would reach attempt N-1's, gone (connection refused)."""
    import datetime

    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(seconds=600))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"/job/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))

