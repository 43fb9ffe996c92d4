"""One rank of a torchrun job whose rank 0 is killed with SIGKILL right after its first step,
for the recovery test (tests/test_recovery.py): what a killed attempt leaves behind.

Zero-code (MEGACACHE_URL and MEGACACHE_MODEL in the environment; nothing here calls
megacache), compiled the way many trainers do it now: `model.compile()`. Each attempt runs
as on a new machine: before torch is imported, its Inductor and Triton caches, TMPDIR, the
megacache node cache and the g++ log point to directories of the attempt's own.

Attempt 0 fails at the realistic point, before any settled point: each rank does its first
step (the compile) and nothing more. Rank 0 waits until rank 1's first step has ended too
(its counters file: every rank has compiled), notes whether the server has an entry yet,
and SIGKILLs itself: no handler of its own runs. Rank 1, like a rank blocked in a collective
with a dead peer, waits for the end of the attempt: torchrun's agent, seeing rank 0 dead,
sends it SIGTERM. So what attempt 1 finds on the server is what the SIGTERM path
(`steps/preemption.py`: the publish on SIGTERM, within `term_grace_s`) left behind; no
settled round has run (the ranks stopped stepping). torchrun (`--max-restarts 1`) starts
attempt 1, which trains STEPS steps. Each rank writes torch's own cache counters to
$RESULT_DIR/rank<N>-attempt<A>.json after its first step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
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


def wait_for(path: Path, why: str) -> None:
    """Wait for a file another rank writes (bounded: a broken job fails, never hangs)."""
    deadline = time.monotonic() + 300
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"attempt {ATTEMPT} rank {RANK}: {why} never came")
        time.sleep(0.05)


def main() -> None:
    url, model_name = os.environ["MEGACACHE_URL"], os.environ["MEGACACHE_MODEL"]
    steps = int(os.environ.get("STEPS", "4"))
    results = Path(os.environ["RESULT_DIR"])
    torch.manual_seed(0)
    model = TinyNet()
    model.compile()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(RANK * 10 + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            (results / f"rank{RANK}-attempt{ATTEMPT}.json").write_text(
                json.dumps({"rank": RANK, "attempt": ATTEMPT, **cache_counters()}))
        if ATTEMPT == 0 and RANK == 0:  # killed once every rank has compiled
            wait_for(results / "rank1-attempt0.json", "rank 1's first step")
            print(f"rank 0 killed after step {step}; published before the kill: "
                  f"{published(url, model_name)}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # rank 1's next step would wait for rank 0, which died: torchrun's SIGTERM ends it
        if ATTEMPT == 0 and RANK == 1 and not threading.Event().wait(300):
            raise SystemExit("attempt 0: rank 1 was never stopped")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
