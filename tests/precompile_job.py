"""A small trainer for the precompiled-Dynamo verification tests.

    python tests/precompile_job.py plain|flip [exit|killed]

`flip` installs a real Inductor post-grad pass that turns every relu into a sigmoid: the
compiled graphs then compute something other than the graph Dynamo traced, as a
miscompiling pass would, so the publisher's child-process check must find them unequal.
Every run of a kind computes the same (the pass is part of its compile), so its losses
still match from one machine to the next. Prints one JSON line: losses, torch's own
counters, the session's event and the loaded entry's bundle meta.

`killed` (the producer of the background-publish test): no exit round, which would wait for
the precompile check and ship the verified entries itself. The job trains on until the
publisher's child check has ended and the round its verdicts start (in the background) has
ended too, prints, and dies by SIGKILL: what is on the server then, the background round
put there.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import megacache_client
from megacache_client.torch import env as torch_env
from megacache_client.torch import precompile
from megacache_client.torch.precompile import verify as precompile_verify

KIND = sys.argv[1]
_log = logging.StreamHandler()  # the client's INFO lines, prefixed so they are no warnings
_log.setFormatter(logging.Formatter("info %(message)s"))
logging.getLogger("megacache").addHandler(_log)
logging.getLogger("megacache").setLevel(logging.INFO)
SESSION = megacache_client.enable(model=f"precompile-{KIND}", code="c1")


class ReluToSigmoid(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.target is torch.ops.aten.relu.default:
                node.target = torch.ops.aten.sigmoid.default

    def uuid(self) -> str:
        return "relu-to-sigmoid"


if KIND == "flip":
    torch._inductor.config.post_grad_custom_post_pass = ReluToSigmoid()


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(model)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    losses, first = [], 0.0

    def train() -> float:
        loss = torch.nn.functional.mse_loss(step(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(3):
        started = time.perf_counter()
        losses.append(train())
        first = first or time.perf_counter() - started
    traced = counters["stats"]["unique_graphs"]  # graphs Dynamo traced in this process
    killed = sys.argv[2:] == ["killed"]
    if killed:
        until_the_check_s_round_ended(train)
    else:
        SESSION.close()
    event = SESSION.event()
    entry = SESSION.load_result.entry
    print(json.dumps({
        "losses": losses, "first_step_s": first, "traced_graphs": traced,
        "counters": torch_env.cache_counters(), "precompile": precompile.counters(),
        "outcome": event.outcome if event else None,
        "precompile_reason": getattr(event, "precompile_reason", None) if event else None,
        "published": SESSION.publish_result.published,
        "check_s": precompile_verify.LAST_SECONDS[0],
        "loaded_meta": dict(entry.blob("megacache").meta) if entry else None,
        "loaded_counts": entry.artifact_counts if entry else None,
    }), flush=True)
    if killed:
        os.kill(os.getpid(), signal.SIGKILL)


def until_the_check_s_round_ended(train: Callable[[], float]) -> None:
    """Train on until the child check (started by a settled point's round) has ended, then
    wait for its thread (which starts the verdicts' round) and for the round under way.
    Waits on the check, not on a publish: with the verdicts' round gone, this still ends."""
    deadline = time.monotonic() + 300
    while precompile_verify.LAST_SECONDS[0] == 0:  # set when the check's child has ended
        if time.monotonic() > deadline:
            raise SystemExit("the precompile check never ended")
        train()
        time.sleep(0.05)
    for thread in threading.enumerate():
        if thread.name == "megacache-precompile-check":
            thread.join(60)
    SESSION.publisher.join(300)


if __name__ == "__main__":
    main()
