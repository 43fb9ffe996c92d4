"""One rank of a torchrun job whose rank 0 is killed with SIGKILL mid-run, for the recovery
test (tests/test_recovery.py): what a killed attempt leaves behind.

Zero-code (MEGACACHE_URL and MEGACACHE_MODEL in the environment; nothing here calls
megacache), compiled the way many trainers do it now: `model.compile()`. Each attempt runs
as on a new machine: before torch is imported, its Inductor and Triton caches, TMPDIR, the
megacache node cache and the g++ log point to directories of the attempt's own. In attempt
0, rank 0 trains until the server has an entry for the model (the client published at the
settled point, off the loop), then SIGKILLs itself: no exit handler runs. torchrun
(`--max-restarts 1`) starts attempt 1, which trains STEPS steps. Each rank writes torch's
own cache counters to $RESULT_DIR/rank<N>-attempt<A>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
RANK = int(os.environ["RANK"])
MACHINE = Path(os.environ["MACHINES"]) / f"attempt{ATTEMPT}"
for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                  ("TMPDIR", "tmp"), ("MEGACACHE_NODE_CACHE_DIR", "node")):
    (MACHINE / sub).mkdir(parents=True, exist_ok=True)
    os.environ[name] = str(MACHINE / sub)
os.environ["GXX_LOG"] = str(MACHINE / "gxx.log")

import httpx  # noqa: E402
import torch  # noqa: E402  (the client enables itself right after this import)
from torchrun_job import TinyNet  # noqa: E402

from benchmarks.harness.job_counters import cache_counters  # noqa: E402


def published(url: str, model: str) -> bool:
    try:
        r = httpx.get(f"{url}/v1/ac", params={"model": model}, timeout=5)
        return r.status_code == 200 and bool(r.json()["entries"])
    except httpx.HTTPError:
        return False


def main() -> None:
    url, model_name = os.environ["MEGACACHE_URL"], os.environ["MEGACACHE_MODEL"]
    steps = int(os.environ.get("STEPS", "4"))
    torch.manual_seed(0)
    model = TinyNet()
    model.compile()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    deadline = time.monotonic() + 120
    while True:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(RANK * 10 + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 1:
            Path(os.environ["RESULT_DIR"], f"rank{RANK}-attempt{ATTEMPT}.json").write_text(
                json.dumps({"rank": RANK, "attempt": ATTEMPT, **cache_counters()}))
        if ATTEMPT == 0 and RANK == 0 and step >= 2 and published(url, model_name):
            print(f"rank 0 killed after step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if ATTEMPT == 0 and time.monotonic() > deadline:
            raise SystemExit("attempt 0: nothing published within 120 s")
        if ATTEMPT > 0 and step >= steps:
            break
        time.sleep(0.05)


if __name__ == "__main__":
    main()
