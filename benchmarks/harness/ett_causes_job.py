"""A trainer that fails by one cause and is run again: the job of the ETT causes and
components benchmark and test (benchmarks/ett_causes.py, tests/test_ett_causes.py), and of
the alerts' end-to-end test (tests/test_alerts.py). Zero-code: nothing here calls
megacache; the job's identity is the node's record of the command (a rerun after a
failure is its next attempt) unless the environment names it (SLURM_JOB_ID,
SLURM_RESTART_COUNT).

Each run: a gloo process group of one rank and two more groups (`new_group`), a small
model and its optimizer (BUILD_S of building), a restore of the latest DCP checkpoint
when there is one, a DataLoader whose first batch takes FIRST_BATCH_S, then STEPS steps
(STEP_S each) with a DCP checkpoint every CKPT_EVERY. Run 0 (RUN=0) fails after step
FAIL_AT by CAUSE:

- sigterm: writes $READY and waits for the test's SIGTERM (Python's default action);
- exception: raises ValueError; oom: a real allocator error (an allocation of 4 EiB);
- exit3: `sys.exit(3)`; sigkill: SIGKILL to itself (no exit handler runs).

Its ground truth, by its own clock, goes to $TRUTH_DIR/run<RUN>.jsonl, a line flushed per
fact (a kill loses none): when it started (its first line: after the interpreter's
start-up), when `import torch` ended, each phase's span, each save, the first step's end,
the failure, the end.
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402  (the client is enabled right after this import)

IMPORTED = time.time()

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

RUN = int(os.environ["RUN"])
TRUTH = Path(os.environ["TRUTH_DIR"]) / f"run{RUN}.jsonl"


def fact(name: str, **fields: Any) -> None:
    with open(TRUTH, "a") as f:
        f.write(json.dumps({"fact": name, **fields}) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Slow(Dataset):  # type: ignore[type-arg]
    """Random samples; the first costs FIRST_BATCH_S (a cold file system, a worker's
    start)."""

    def __init__(self, first_s: float) -> None:
        self.first_s = first_s

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.first_s:
            time.sleep(self.first_s)
            self.first_s = 0.0
        return torch.randn(64)


def fail(cause: str) -> None:
    fact("fail", at=time.time(), cause=cause)
    if cause == "sigterm":
        Path(os.environ["READY"]).write_text(str(time.time()))
        time.sleep(120)
    elif cause == "exception":
        raise ValueError("the trainer's own bug")
    elif cause == "oom":
        torch.empty(1 << 62, dtype=torch.uint8)
    elif cause == "exit3":
        sys.exit(3)
    elif cause == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    steps, every = int(os.environ["STEPS"]), int(os.environ["CKPT_EVERY"])
    step_s, fail_at = float(os.environ["STEP_S"]), int(os.environ["FAIL_AT"])
    ckpt = Path(os.environ["CKPT_DIR"])
    fact("started", at=STARTED)
    fact("imported", at=IMPORTED)

    at = time.time()
    store = dist.FileStore(str(ckpt / f"store-{RUN}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    groups = [dist.new_group([0]) for _ in range(2)]
    fact("distributed", at=at, seconds=time.time() - at, groups=1 + len(groups))

    at = time.time()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    time.sleep(float(os.environ.get("BUILD_S", "0.3")))  # a bigger model's build
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fact("model_build", at=at, seconds=time.time() - at)

    done = 0
    marker = ckpt / "latest"
    if marker.exists():
        done = int(marker.read_text())
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        at = time.time()
        dcp.load(state, checkpoint_id=str(ckpt / f"step-{done}"))
        fact("restore", at=at, seconds=time.time() - at, step=done)

    at = time.time()
    batches = iter(DataLoader(Slow(float(os.environ.get("FIRST_BATCH_S", "0.4"))),
                              batch_size=8))
    batch = next(batches)
    fact("first_batch", at=at, seconds=time.time() - at)

    for step in range(done + 1, steps + 1):
        model(batch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == done + 1:
            fact("first_step_end", at=time.time())
        time.sleep(step_s)
        batch = next(batches)
        if step % every == 0:
            at, began = time.time(), time.monotonic()
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                     checkpoint_id=str(ckpt / f"step-{step}"))
            blocking = time.monotonic() - began
            marker.write_text(str(step))
            fact("save", at=at, blocking_s=blocking, step=step)
        if RUN == 0 and step == fail_at:
            fail(os.environ["CAUSE"])
    dist.destroy_process_group()
    fact("end", at=time.time())


if __name__ == "__main__":
    main()
