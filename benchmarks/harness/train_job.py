"""One small training job in this process: what a trainer does, measured.

    python benchmarks/harness/train_job.py --model mlp --steps 3 --megacache explicit \
        --result r.json

`--megacache off` compiles with torch alone; `explicit` calls `megacache_client.enable()`;
`env` relies on the autoload hook (MEGACACHE_URL set, no code). Timings are from process
start, so imports count, as they do for a real job. Used by the demo, tests and benchmarks.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--megacache", choices=("off", "explicit", "env"), default="off")
    parser.add_argument("--name", help="model name for the fingerprint (default: class name)")
    parser.add_argument("--code", help="code id for the fingerprint (default: source hash)")
    parser.add_argument("--shapes", choices=("fixed", "varying"), default="fixed",
                        help="varying: batch sizes change after step 1 (automatic dynamic)")
    parser.add_argument("--load-bundle", type=Path,
                        help="torch's load_cache_artifacts of this file only (no megacache)")
    parser.add_argument("--save-bundle", type=Path, help="save_cache_artifacts to this file")
    parser.add_argument("--result", type=Path, help="write the measurements here as JSON")
    parser.add_argument("--init-s", type=float, default=0.0,
                        help="simulated trainer initialisation (data loading): seconds of "
                             "sleep between `import torch` and torch.compile")
    parser.add_argument("--eager-check", action="store_true",
                        help="train an eager copy side by side; report the largest loss gap")
    parser.add_argument("--eager", action="store_true",
                        help="no torch.compile at all: the floor a compile cache works toward")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model trains (cuda: GPU 0, Triton kernels)")
    parser.add_argument("--loader-s", type=float,
                        help="batches from a DataLoader (2 workers) whose workers take this "
                             "many seconds to yield their first batch (a slow data start)")
    parser.add_argument("--warm-up", action="store_true",
                        help="megacache_client.warm_up(model, fast batch) while the "
                             "DataLoader's workers start (needs --loader-s)")
    parser.add_argument("--precompile", action="store_true",
                        help="torch alone: turn torch._dynamo.config.caching_precompile on")
    args = parser.parse_args()

    import torch

    from benchmarks.harness import models

    marks = {"torch_imported_s": time.time() - PROCESS_START}
    session = None
    if args.megacache == "explicit":
        import megacache_client

        session = megacache_client.enable(model=args.name, code=args.code)
    if args.precompile:
        torch._dynamo.config.caching_precompile = True
    if args.load_bundle:
        torch.compiler.load_cache_artifacts(args.load_bundle.read_bytes())
    if args.init_s:
        time.sleep(args.init_s)  # the trainer's own set-up; prefetch overlaps it

    marks["initialised_s"] = time.time() - PROCESS_START
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"train_job: --device cuda, but torch {torch.__version__} sees no CUDA GPU",
              file=sys.stderr)
        return 3
    model, make_batch, loss_fn = models.build(args.model, args.device)
    marks["built_s"] = time.time() - PROCESS_START
    sizes = [0] * args.steps if args.shapes == "fixed" else \
        [8 + 4 * (i % 3) for i in range(args.steps)]
    # the loader's workers start first: they fill while torch.compile is set up
    batches = loader_batches(make_batch, sizes, args.loader_s) \
        if args.loader_s is not None else (make_batch(size) for size in sizes)
    marks["loader_started_s"] = time.time() - PROCESS_START
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marks["optimizer_s"] = time.time() - PROCESS_START
    eager = copy.deepcopy(model) if args.eager_check else None
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.01) if eager is not None else None
    eager_gap = 0.0
    compiled = model if args.eager else torch.compile(model)
    marks["compile_called_s"] = time.time() - PROCESS_START
    warming = None
    if args.warm_up:
        import megacache_client

        warming = megacache_client.warm_up(compiled, make_batch(sizes[0])[0])
    step_times = []
    losses = []
    first_step_end = None
    for inputs, target in batches:
        t = time.time()
        loss = loss_fn(compiled(*inputs), target)
        loss.backward()
        losses.append(float(loss.detach()))
        if eager is not None and eager_opt is not None:
            eager_loss = loss_fn(eager(*inputs), target)
            eager_loss.backward()
            eager_opt.step()
            eager_opt.zero_grad()
            eager_gap = max(eager_gap, abs(float(eager_loss.detach()) - losses[-1]))
        opt.step()
        opt.zero_grad()
        if args.device == "cuda":
            torch.cuda.synchronize()  # the step has ended when the GPU has finished it
        step_times.append(time.time() - t)
        if first_step_end is None:
            first_step_end = time.time()

    from torch._dynamo.utils import counters

    from megacache_client.torch import env as torch_env
    from megacache_client.torch import vec_isa

    result = {
        "model": args.model,
        "time_to_first_step_s": round((first_step_end or time.time()) - PROCESS_START, 3),
        "first_step_s": round(step_times[0], 3),
        "steady_step_s": round(sorted(step_times[1:])[len(step_times[1:]) // 2], 4)
        if len(step_times) > 1 else None,
        "compile_s": round(torch_env.compile_seconds(), 3),
        "counters": torch_env.cache_counters(),
        "frames": int(counters["stats"]["unique_graphs"]),
        "precompile_hit": int(counters["dynamo_cache"]["dynamo_cache_hit"]),
        "loss": float(loss.detach()),
        "losses": losses,
        "eager_gap": eager_gap if eager is not None else None,
        "marks": {k: round(v, 3) for k, v in marks.items()},  # seconds from process start
        "warm_up_s": warming.wait(0) if warming is not None else None,
        "warm_up_error": warming.error if warming is not None else None,
        "device": args.device,
        "gpu": torch_env.device_description() if args.device == "cuda" else None,
    }
    if args.save_bundle:
        saved = torch.compiler.save_cache_artifacts()
        if saved:
            args.save_bundle.write_bytes(saved[0])
    if args.megacache == "env":
        from megacache_client.torch import hook

        session = hook.active_session()
    if session is not None:
        event = session.close()
        lr, pr = session.load_result, session.publish_result
        result["megacache"] = {
            "outcome": event.outcome if event else lr.outcome,
            "reason": lr.reason,
            "differing": lr.differing,
            "key": lr.key,
            "entry_key": lr.entry.key if lr.entry else None,
            "saved_s": event.saved_s if event else 0.0,
            "load_s": round(lr.seconds, 3),
            "load_steps": lr.steps,
            "bytes_down": lr.bytes_down,
            "placed": lr.placed,
            "skipped": lr.skipped,
            "published": pr.published,
            "publish_reason": pr.reason,
            "bytes_up": pr.bytes_up,
            "precompile": lr.precompile or session.precompile_off,
            "isa_probe": vec_isa.probed_on(),  # the thread that ran torch's ISA probe
            "prefetch": None if session.prefetcher is None else {
                k: v for k, v in vars(session.prefetcher.result).items()
                if k in ("bytes_down", "toolchain_bytes", "error", "entry_key")},
            "tts": {k: v for k, v in (event.to_dict() if event else {}).items()
                    if k.startswith(("tts_", "precompile_"))},
        }
    line = json.dumps(result)
    print(line, flush=True)
    if args.result:
        args.result.write_text(line)
    os.environ.pop("MEGACACHE_URL", None)
    return 0


def loader_batches(make_batch: Callable[[int], Any], sizes: list[int],
                   first_batch_s: float) -> Iterator[Any]:
    """The batches from a DataLoader's 2 worker processes, each of which sleeps
    `first_batch_s` before its first batch (a dataset opening its shards, say); the
    iterator is started here, so the workers start now."""
    import torch.utils.data

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(sizes)

        def __getitem__(self, i: int) -> Any:
            return make_batch(sizes[i])

    loader = torch.utils.data.DataLoader(
        Batches(), batch_size=None, num_workers=2,
        worker_init_fn=lambda _worker: time.sleep(first_batch_s))
    return iter(loader)


if __name__ == "__main__":
    sys.exit(main())
