"""A tiny single-process trainer for the telemetry tests, with the client enabled zero-code
(MEGACACHE_URL and MEGACACHE_JOB_ID in its environment; no megacache call in the loop).

It trains STEPS optimizer steps of a small MLP (STEP_S seconds of sleep in each, standing
for the work), takes a checkpoint every CKPT_EVERY steps with torch.distributed.checkpoint
(SAVE=sync: `dcp.save`, async: `dcp.async_save`, api: `torch.save` inside
`megacache_client.checkpoint()`), restores the first checkpoint once (`dcp.load`), and
raises at step FAIL_AT when set. It records its own ground truth, by its own clock, to
TRUTH (JSON): when it started, when its first step ended, each checkpoint's blocking time.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before torch is imported: the interpreter's start-up is not in it

import json  # noqa: E402
import os  # noqa: E402
from concurrent.futures import Future  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, cast  # noqa: E402

import torch  # noqa: E402  (the client is enabled right after this import)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

BALLAST = 8_000_000
"""float32 elements saved and restored with the model (32 MB)."""


def main() -> None:
    steps, every = int(os.environ["STEPS"]), int(os.environ["CKPT_EVERY"])
    step_s, mode = float(os.environ.get("STEP_S", "0")), os.environ.get("SAVE", "sync")
    fail_at = int(os.environ.get("FAIL_AT", "-1"))
    ckpt = Path(os.environ["CKPT_DIR"])
    saves: list[dict[str, float]] = []
    loads: list[dict[str, float]] = []
    truth: dict[str, Any] = {"started": STARTED, "saves": saves, "loads": loads}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pending: Future[Any] | None = None
    ballast = torch.zeros(BALLAST)
    for step in range(1, steps + 1):
        loss = model(torch.randn(32, 256)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(step_s)
        if step == 1:
            truth["first_step_end"] = time.time()
        if step == fail_at:
            Path(os.environ["TRUTH"]).write_text(json.dumps(truth))
            raise RuntimeError(f"simulated failure at step {step}")
        if step % every:
            continue
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "ballast": ballast}
        at, began = time.time(), time.monotonic()
        if mode == "async":
            if pending is not None:
                pending.result()
            pending = cast(Future, dcp.async_save(state, checkpoint_id=str(ckpt / f"step-{step}")))
        elif mode == "api":
            import megacache_client

            with megacache_client.checkpoint():
                torch.save(state, ckpt / f"step-{step}.pt")
        else:
            dcp.save(state, checkpoint_id=str(ckpt / f"step-{step}"))
        saves.append({"step": step, "at": at, "blocking_s": time.monotonic() - began})
        if step == every and mode != "api":  # a restore, as a restart would do
            if pending is not None:
                pending.result()
            at, began = time.time(), time.monotonic()
            dcp.load(state, checkpoint_id=str(ckpt / f"step-{step}"))
            loads.append({"at": at, "blocking_s": time.monotonic() - began})
    if pending is not None:
        pending.result()
    truth["end"] = time.time()
    Path(os.environ["TRUTH"]).write_text(json.dumps(truth))


if __name__ == "__main__":
    main()
