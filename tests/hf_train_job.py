"""A Hugging Face `transformers` training script that knows nothing about megacache.

A tiny GPT-2 built from a config in code (no hub download), compiled with `model.compile()`,
trained for two steps. The cache is switched on from outside (MEGACACHE_URL and the autoload
hook); the script only prints torch's own cache counters as one JSON line.
"""

from __future__ import annotations

import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.harness.job_counters import cache_counters  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(json.dumps({
        "loss": float(loss),
        **cache_counters(),
    }), flush=True)


if __name__ == "__main__":
    main()
