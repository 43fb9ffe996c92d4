"""What the publisher's check of precompiled Dynamo output costs, model by model.

    python -m benchmarks precompile_check_bench --models mlp,transformer,dlrm,conv
    python -m benchmarks precompile_check_bench --corpus gpt2,llama,bert,resnet,vit,t5

Each model runs in a fresh process with its own Inductor cache: compiled with precompiled
Dynamo on (the client's patches in place, as `enable()` puts them), one training step,
torch's Mega-Cache saved, then the check a publish runs in its background thread
(`precompile_verify.verify`: a child process loads every precompile artifact fresh and
compares its graphs with the traced ones). Prints one JSON line per model (the child's
wall seconds, how many artifacts were checked and why any failed) and writes them as the
record's rows (`--out`, default benchmarks/results/precompile_check.json). `--corpus` takes
the transformers models of benchmarks/harness/corpus_job.py (in train mode, so their
dropout graphs are compared by shapes and dtypes only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.record import RESULTS, given_argv, make_record, write_record


def one(name: str, corpus: bool) -> dict[str, object]:
    """Compile `name`, take one step, time the check of its precompile artifacts."""
    import torch

    from megacache_client.config import ClientConfig
    from megacache_client.torch import megacache_io, precompile
    from megacache_client.torch.precompile import verify as precompile_verify

    assert precompile.turn_on(ClientConfig()) == ""
    if corpus:
        from benchmarks.harness.corpus_job import CORPUS

        torch.manual_seed(0)
        model, batch = CORPUS[name]()
        model.train()
        compiled = torch.compile(model)
        compiled(**batch).loss.backward()
    else:
        from benchmarks.harness.models import build

        model, make_batch, loss_fn = build(name)
        inputs, target = make_batch(0)
        loss_fn(torch.compile(model)(*inputs), target).backward()
    saved = megacache_io.save_bundle(precompile=True)
    artifacts = megacache_io.read_artifacts(saved[0]) if saved else None
    items = (artifacts or {}).get(precompile.ARTIFACT_TYPE, [])
    started = time.monotonic()
    failed = precompile_verify.verify(artifacts or {}, precompile.ARTIFACT_TYPE)
    return {"model": name, "artifacts": len(items), "verified": len(items) - len(failed),
            "check_s": round(time.monotonic() - started, 2), "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,transformer,dlrm,conv")
    parser.add_argument("--corpus", default="", help="harness/corpus_job.py models instead")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "precompile_check.json")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, bool(args.corpus))), flush=True)
        return 0
    rows = []
    names = (args.corpus or args.models).split(",")
    for name in names:
        with tempfile.TemporaryDirectory(prefix="precompile-check-") as tmp:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
                   "MEGACACHE_MODE": "off", "HF_HUB_OFFLINE": "1"}
            cmd = [sys.executable, __file__, "--one", name]
            if args.corpus:
                cmd += ["--corpus", "1"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            lines = proc.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
                {"model": name, "error": proc.stderr.strip().splitlines()[-1:]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_record(make_record("precompile_check_bench", given_argv(argv), rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
