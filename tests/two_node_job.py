"""One rank of a two-node torchrun job for the fleet test: look up the fixed fingerprint
(model and code from the environment), say what it got, then join the job's gloo group.

$NODE_NAME says which launch the rank belongs to (c10d rendezvous numbers the nodes in
the order they join). On the node launched with $WAIT_FOR set, ranks look up only once
that file exists, so the test can publish between one node's lookups and the other's.
Each rank writes what it saw to $RESULT_DIR/rank<N>.json before the group forms: a job
whose ranks disagreed would still show it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import megacache_client


def main() -> None:
    flag = os.environ.get("WAIT_FOR")
    while flag and not Path(flag).exists():
        time.sleep(0.1)
    session = megacache_client.enable(model=os.environ["JOB_MODEL"],
                                      code=os.environ["JOB_CODE"], load_now=True)
    r = session.load_result
    bundle = r.entry.blob("megacache") if r.entry is not None else None
    rank = int(os.environ["RANK"])
    done = Path(os.environ["RESULT_DIR"], f"rank{rank}.json")
    done.with_suffix(".part").write_text(json.dumps({
        "rank": rank, "node": os.environ["NODE_NAME"], "outcome": r.outcome, "reason": r.reason,
        "bundle": bundle.digest if bundle else None}))
    done.with_suffix(".part").rename(done)  # whole, or not there
    dist.init_process_group("gloo")
    agreed = torch.tensor([1.0 if r.outcome == "hit" else 0.0])
    dist.all_reduce(agreed)  # every rank of the job in one collective, as a trainer's first
    dist.destroy_process_group()
    session.close()


if __name__ == "__main__":
    main()
