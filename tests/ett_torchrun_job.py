"""One rank of a torchrun elastic job (gloo, CPU) that checkpoints, is killed, and resumes:
the ground truth of the ETT e2e test (tests/test_ett_e2e.py).

The client is enabled zero-code (MEGACACHE_URL in the environment; nothing in this file
calls megacache). Each rank trains a small DistributedDataParallel MLP for STEPS steps
(STEP_S seconds of sleep in each, standing for the work) and takes a
torch.distributed.checkpoint every CKPT_EVERY steps; rank 0 then marks the checkpoint as
the latest (after `dcp.save` returned: it is durable). In attempt 0, rank KILL_RANK kills
itself with SIGKILL after step KILL_AT: nothing of it runs after that, no exit handler, no
last record. torchrun (`--max-restarts 1`) starts attempt 1, which loads the latest
checkpoint and trains the rest, redoing the steps since it.

Rank 0 appends its own ground truth, by its own clock, to $TRUTH_DIR/attempt<A>.jsonl as it
goes (a line flushed to disk per fact, so the kill loses none): `started` (the script's
first line: before `import torch`, after the interpreter's start-up), `first_step` (the
first optimizer step of the attempt returned), each `save` (began, blocking seconds,
step), each `load`, `kill` (the moment before the SIGKILL), `end`.
"""

from __future__ import annotations

import time

STARTED = time.time()

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402  (the client is enabled right after this import)
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402


class Truth:
    def __init__(self, path: Path | None) -> None:
        self.path = path

    def write(self, fact: str, **fields: Any) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"fact": fact, **fields}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def latest(ckpt: Path) -> int:
    marker = ckpt / "latest"
    return int(marker.read_text()) if marker.exists() else 0


def join_group(rank: int, attempt: int) -> None:
    """The gloo group of this attempt, its keys under a prefix of the attempt's own.

    torchrun's store outlives an attempt, and with the default `env://` set-up a rank of
    attempt 1 may read the address rank 0 of attempt 0 published (gloo's connectFullMesh
    then times out on a dead port: seen here on every restart)."""
    timeout = timedelta(seconds=120)
    world = int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ett-attempt-{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


def main() -> Any:
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    steps, every = int(os.environ["STEPS"]), int(os.environ["CKPT_EVERY"])
    step_s, kill_at = float(os.environ["STEP_S"]), int(os.environ["KILL_AT"])
    kill_rank = int(os.environ.get("KILL_RANK", "0"))
    ckpt = Path(os.environ["CKPT_DIR"])
    truth = Truth(Path(os.environ["TRUTH_DIR"], f"attempt{attempt}.jsonl") if rank == 0
                  else None)
    truth.write("started", at=STARTED)
    join_group(rank, attempt)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    done = latest(ckpt)
    if done:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        at, began = time.time(), time.monotonic()
        dcp.load(state, checkpoint_id=str(ckpt / f"step-{done}"))
        truth.write("load", at=at, blocking_s=time.monotonic() - began, step=done)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    for step in range(done + 1, steps + 1):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(rank * 1000 + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == done + 1:
            truth.write("first_step", at=time.time(), step=step)
        time.sleep(step_s)
        if attempt == 0 and step == kill_at and rank == kill_rank:
            Truth(Path(os.environ["TRUTH_DIR"], "kill.jsonl")).write("kill", at=time.time(),
                                                                     step=step, rank=rank)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % every == 0:
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            at, began = time.time(), time.monotonic()
            dcp.save(state, checkpoint_id=str(ckpt / f"step-{step}"))
            blocking = time.monotonic() - began
            if rank == 0:
                (ckpt / "latest.tmp").write_text(str(step))
                os.replace(ckpt / "latest.tmp", ckpt / "latest")
            truth.write("save", at=at, blocking_s=blocking, step=step, durable=time.time())
    dist.barrier()
    dist.destroy_process_group()
    truth.write("end", at=time.time(), step=steps)
    return model  # kept alive by the caller: see below


if __name__ == "__main__":
    KEPT = main()
    # torch's gloo teardown can deadlock: the DDP Reducer's destructor (holding the GIL)
    # joins gloo's worker thread, which waits for the GIL to free the barrier's tensors
    # (seen in CI: a rank hung for ever after its job had ended; py-spy showed the main
    # thread in ~Reducer as main()'s locals were freed). So the model is never freed: the
    # exit handlers (megacache's end record among them) run, then the process ends.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
