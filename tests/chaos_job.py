"""A trainer that is stopped at a chosen point, for the chaos tests (tests/test_chaos.py).

Zero-code: it knows nothing of megacache (MEGACACHE_URL and MEGACACHE_MODEL come from the
environment and the autoload hook enables the client at `import torch`), except that it
counts the client's publish rounds to know when one is under way.

STOP_KIND: none | sigterm | sigint | sigkill | exception | exit (os._exit(7)).
STOP_POINT, where the stop lands:
- before_first_step: after `torch.compile`, before the model is first called;
- first_compile: STOP_DELAY seconds into the first step (Dynamo and Inductor at work);
- publish: STOP_DELAY seconds into the client's first publish round (it keeps training
  until one starts; with none in 20 s it stops anyway: a round starts at the step
  after a compile settles, and a warm start with nothing new starts none);
- checkpoint: STOP_DELAY seconds into a `torch.distributed.checkpoint.save` after step 2;
- after: once the steps are done, before the exit.
The stop comes from a thread of the process's own (a signal to itself, an exception set
on the main thread, `os._exit`), so it lands where the main thread is at that moment.
COMPILE_STYLE: `function` (torch.compile(model)) or `method` (model.compile()).
CHAOS_BATCHES: the batch size of each step (default 8, STEPS of them). Under torchrun
(WORLD_SIZE > 1) each rank joins a gloo group and all-reduces its loss every step, and
writes its JSON line to $CHAOS_RESULTS/rank<RANK>.json.
With STOP_KIND=none it trains STEPS steps and prints its losses and torch's counters as
one JSON line.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

KIND = os.environ.get("STOP_KIND", "none")
POINT = os.environ.get("STOP_POINT", "after")
DELAY = float(os.environ.get("STOP_DELAY", "0"))
STEPS = int(os.environ.get("STEPS", "3"))


class ChaosStop(RuntimeError):
    """The trainer's own exception, raised at a random point."""


def stop_now() -> None:
    """Stop this process the STOP_KIND way, from whichever thread runs this."""
    if KIND == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif KIND == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
    elif KIND == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif KIND == "exit":
        os._exit(7)
    elif KIND == "exception":
        if threading.current_thread() is threading.main_thread():
            raise ChaosStop("stopped by the trainer's own exception")
        main = threading.main_thread().ident
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main or 0),
                                                   ctypes.py_object(ChaosStop))


def stop_in(seconds: float) -> None:
    """Stop after `seconds` from a timer thread (the main thread goes on meanwhile)."""
    if KIND != "none":
        threading.Timer(seconds, stop_now).start()


def stop_here(point: str) -> None:
    if KIND != "none" and point == POINT:
        stop_now()
        time.sleep(30)  # a signal or an async exception lands here, in the main thread


round_started = threading.Event()
if POINT == "publish" and KIND != "none":
    from megacache_client import publisher

    _snapshot = publisher.snapshot

    def counted_snapshot(*args: Any, **kwargs: Any) -> Any:
        round_started.set()
        return _snapshot(*args, **kwargs)

    publisher.snapshot = counted_snapshot  # type: ignore[assignment]

import torch  # noqa: E402  (the client enables itself right after this import)
from torch import nn  # noqa: E402


class MLP(nn.Module):
    """The trainer's own model class (`nn.Module.compile()` of a torch-only module such as
    a bare `nn.Sequential` compiles nothing: Dynamo skips torch's own frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)) \
        if os.environ.get("COMPILE_STYLE") != "method" else MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if os.environ.get("COMPILE_STYLE") == "method":
        model.compile()
        run: Any = model
    else:
        run = torch.compile(model)
    sizes = [int(n) for n in os.environ.get("CHAOS_BATCHES", "").split(",") if n] or [8] * STEPS
    batches = [torch.randn(n, 16, generator=torch.Generator().manual_seed(i))
               for i, n in enumerate(sizes)]
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        from benchmarks.harness.gloo_group import init_group

        init_group()
    stop_here("before_first_step")
    losses: list[float] = []
    for step, batch in enumerate(batches):
        if step == 0 and POINT == "first_compile":
            stop_in(DELAY)
        loss = run(batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if distributed:
            dist.all_reduce(loss.detach().clone())  # a peer that stopped holds this rank here
        if step == len(batches) - 1 and POINT == "first_compile" and KIND != "none":
            time.sleep(30)  # a warm start's steps may end before the stop: it lands here
        if step == 1 and POINT == "checkpoint" and KIND != "none":
            import torch.distributed.checkpoint as dcp

            state = {"model": model.state_dict(), "ballast": torch.zeros(4_000_000)}
            stop_in(DELAY)
            dcp.save(state, checkpoint_id=os.environ["CKPT_DIR"])
            time.sleep(30)
    if POINT == "publish" and KIND != "none":
        deadline = time.monotonic() + 20
        while not round_started.is_set() and time.monotonic() < deadline:
            loss = run(batches[0]).pow(2).mean()  # settled points come with optimizer steps
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)
        stop_in(DELAY)
        time.sleep(30)
    stop_here("after")
    from torch._dynamo.utils import counters

    from megacache_client.torch import env as torch_env
    from megacache_client.torch import hook

    session = hook.active_session()
    outcome = session.load_result.outcome if session is not None else None
    line = json.dumps({"losses": losses, "counters": torch_env.cache_counters(),
                       "outcome": outcome,
                       "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       "precompile_hit": int(counters["dynamo_cache"]["dynamo_cache_hit"]),
                       "unique_graphs": int(counters["stats"]["unique_graphs"])})
    print(line, flush=True)
    if os.environ.get("CHAOS_RESULTS"):
        Path(os.environ["CHAOS_RESULTS"], f"rank{os.environ.get('RANK', '0')}.json"
             ).write_text(line)
    if distributed:
        dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo's teardown can deadlock a rank (tests/torchrun_job.py): the exit handlers
        # run, then the process ends without freeing the process group
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
