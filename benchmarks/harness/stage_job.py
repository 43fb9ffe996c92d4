"""One rank of a torchrun job whose ranks compile different things, for tests/test_ranks.py
and benchmarks/ranks_bench.py. Zero-code: MEGACACHE_URL and MEGACACHE_MODEL come from the
environment and the autoload hook enables the client at `import torch`.

STAGES:
- `differ` (default): each rank compiles its own stage, as pipeline stages do: rank 0 an
  embedding and two linear layers, rank 1 three other layers and a head (ranks past 1
  repeat rank 1's layers with other widths);
- `same`: every rank compiles rank 0's stage (data parallel);
- `rank_constant`: every rank compiles `x * (dist.get_rank() + 1)`, a function whose
  graph Dynamo specialises on the rank with no guard.
Every step all-reduces each rank's loss (a step is as slow as the slowest rank).

MACHINES: when set, each attempt runs on new machines (its Inductor and Triton caches,
TMPDIR and node cache under $MACHINES/attempt<N>/rank<R>, set before torch is imported).
KILL_RANK: in attempt 0, that rank SIGKILLs itself once its compile is published (it waits
for its own publish round, at most 120 s); torchrun restarts the attempt.
READ_ONLY_RANKS: ranks that only read the cache (MEGACACHE_MODE=read-only).
Each rank writes $RESULT_DIR/rank<R>-attempt<A>.json: torch's counters, precompiled Dynamo
hits, the first step's seconds, the losses, and what its publish did (after each step, the
losses so far, marked `partial`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

PROCESS_START = time.time()
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
if os.environ.get("MACHINES"):
    machine = Path(os.environ["MACHINES"]) / f"attempt{ATTEMPT}" / f"rank{RANK}"
    for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                      ("TMPDIR", "tmp"), ("MEGACACHE_NODE_CACHE_DIR", "node")):
        (machine / sub).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(machine / sub)
    os.environ["GXX_LOG"] = str(machine / "gxx.log")
if str(RANK) in os.environ.get("READ_ONLY_RANKS", "").split(","):
    os.environ["MEGACACHE_MODE"] = "read-only"

if os.environ.get("STAGE_DEBUG"):
    import logging

    logging.basicConfig(level=logging.DEBUG, format=f"[r{RANK}] %(message)s")
    for noisy in ("torch", "httpx", "httpcore", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

import torch  # noqa: E402  (the client enables itself right after this import)
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.harness.gloo_group import init_group  # noqa: E402

STAGES = os.environ.get("STAGES", "differ")
STEPS = int(os.environ.get("STEPS", "3"))


class Stage(nn.Module):
    """One pipeline stage: the same class on every rank (so the same code fingerprint, as
    a model split into stages has), its layers the rank's own."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def stage(rank: int) -> tuple[nn.Module, torch.Tensor]:
    """The module this rank compiles, and its input."""
    g = torch.Generator().manual_seed(100 + rank)
    if STAGES == "same" or rank == 0:
        return (Stage(nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.ReLU(),
                                    nn.Linear(32, 32))),
                torch.randint(0, 64, (4, 6), generator=g))
    width = 48 + 16 * rank
    return (Stage(nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 32),
                                nn.ReLU(), nn.Linear(32, 10))),
            torch.randn(4, 6, 32, generator=g))


def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * (dist.get_rank() + 1) + 1


def main() -> dict[str, object]:
    init_group()
    torch.manual_seed(0)
    losses: list[float] = []
    first_step_s = first_step_end = None
    if STAGES == "rank_constant":
        run = torch.compile(scaled)
        for step in range(STEPS):
            t = time.time()
            out = run(torch.full((4,), float(step)))
            losses.append(float(out.sum()))
            if first_step_s is None:
                first_step_s, first_step_end = time.time() - t, time.time() - PROCESS_START
            dist.all_reduce(out.clone())
    else:
        model, x = stage(RANK)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.compile()
        for step in range(STEPS):
            t = time.time()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            dist.all_reduce(loss.detach().clone())
            if first_step_s is None:
                first_step_s, first_step_end = time.time() - t, time.time() - PROCESS_START
            write({"rank": RANK, "attempt": ATTEMPT, "losses": losses, "partial": True})
            if ATTEMPT == 0 and str(RANK) == os.environ.get("KILL_RANK"):
                await_publish(opt)
                print(f"rank {RANK} killed after step {step + 1}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    from torch._dynamo.utils import counters

    from megacache_client.torch import env as torch_env
    from megacache_client.torch import hook

    dist.barrier()
    session = hook.active_session()
    if session is not None:
        session.close()  # what the exit does: its publish and report, then the figures
    pr = session.publish_result if session is not None else None
    lr = session.load_result if session is not None else None
    return {"rank": RANK, "attempt": ATTEMPT, "losses": losses,
            "first_step_s": round(first_step_s or 0.0, 3),
            "to_first_step_s": round(first_step_end or 0.0, 3),
            "counters": torch_env.cache_counters(),
            "precompile_hit": int(counters["dynamo_cache"]["dynamo_cache_hit"]),
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "outcome": lr.outcome if lr else None, "load_reason": lr.reason if lr else "",
            "withheld": sorted(f"{k}:{v[:12]}" for k, v in lr.withheld) if lr else [],
            "bytes_down": lr.bytes_down if lr else 0,
            "published": pr.published if pr else False,
            "publish_reason": pr.reason if pr else "", "bytes_up": pr.bytes_up if pr else 0}


def write(result: dict[str, object]) -> None:
    """This rank's results so far (a rank of a failed attempt leaves its first steps')."""
    path = Path(os.environ["RESULT_DIR"], f"rank{RANK}-attempt{ATTEMPT}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def await_publish(opt: torch.optim.Optimizer) -> None:
    """Until this rank's compile reached the server (its settled point's round: optimizer
    steps make the settled points, so it keeps stepping, with no gradients)."""
    from megacache_client.torch import hook

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        session = hook.active_session()
        if session is not None and session.publish_result.published:
            return
        opt.step()
        time.sleep(0.2)
    session = hook.active_session()
    why = session.publish_result.reason if session is not None else "no session"
    raise SystemExit(f"rank {RANK}: nothing published within 120 s: {why}")


if __name__ == "__main__":
    write(main())
    # gloo's teardown can deadlock a rank (tests/torchrun_job.py): the exit handlers run,
    # then the process ends without freeing the process group
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
