"""Third-party models nobody here wrote, trained a few steps with `torch.compile(model)`.

    python benchmarks/harness/corpus_job.py resnet [steps] [--eager]

The script knows nothing about megacache: the cache is switched on from outside (the
autoload hook and `MEGACACHE_*` variables), as a user would. Each model is a Hugging Face
`transformers` architecture built from a tiny config in code (no weights download), so a
new machine compiles exactly what the cold one did. It prints one JSON line: the losses
(as exact float reprs, so a test can compare bit for bit), torch's own cache counters, and
seconds from process start to the end of step 1 with marks on the way (for
benchmarks/budget_bench.py --hf; `--eager` trains without torch.compile: the floor).

CORPUS is the one list of models: adding one is one entry.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.harness.job_counters import cache_counters  # noqa: E402

Batch = dict[str, torch.Tensor]


def _tokens(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _images(batch: int, size: int, labels: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (batch,), generator=g)}


def gpt2() -> tuple[Any, Batch]:
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = _tokens(2, 16, 128)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128,
                                      n_positions=32)), {"input_ids": ids, "labels": ids}


def llama() -> tuple[Any, Batch]:
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = _tokens(2, 16, 128)
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, max_position_embeddings=32)), \
        {"input_ids": ids, "labels": ids}


def bert() -> tuple[Any, Batch]:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=128, max_position_embeddings=32, num_labels=3)), \
        {"input_ids": _tokens(4, 16, 128), "labels": torch.tensor([0, 1, 2, 1])}


def resnet() -> tuple[Any, Batch]:
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(
        embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
        num_labels=10)), _images(8, 64, 10)


def vit() -> tuple[Any, Batch]:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=1, hidden_size=32,
        intermediate_size=64, num_attention_heads=2, num_labels=10)), _images(4, 32, 10)


def t5() -> tuple[Any, Batch]:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=2, decoder_start_token_id=0)), \
        {"input_ids": _tokens(2, 12, 128), "labels": _tokens(2, 8, 128, seed=2)}


CORPUS: dict[str, Callable[[], tuple[Any, Batch]]] = {
    "gpt2": gpt2,  # language: causal LM, learned positions
    "llama": llama,  # language: rotary embeddings, RMSNorm, grouped-query attention
    "bert": bert,  # encoder: sequence classification
    "resnet": resnet,  # vision: convolutions and batch norm
    "vit": vit,  # vision transformer
    "t5": t5,  # encoder-decoder
}


def since_start() -> float:
    return round(time.time() - PROCESS_START, 3)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--eager"]
    eager = "--eager" in sys.argv[1:]
    name = args[0]
    steps = int(args[1]) if len(args) > 1 else 2
    marks = {"torch_imported_s": since_start()}
    torch.manual_seed(0)
    model, batch = CORPUS[name]()
    model.train()
    marks["built_s"] = since_start()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marks["optimizer_s"] = since_start()
    compiled = model if eager else torch.compile(model)
    marks["compile_called_s"] = since_start()
    losses, step_s = [], []
    for _ in range(steps):
        started = time.time()
        loss = compiled(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        step_s.append(round(time.time() - started, 3))
        if len(step_s) == 1:
            marks["first_step_end_s"] = since_start()
    marks["steps_end_s"] = since_start()
    print(json.dumps({
        "model": name,
        "losses": [repr(x) for x in losses],
        "step_s": step_s,
        "time_to_first_step_s": marks.get("first_step_end_s"),
        "first_step_s": step_s[0] if step_s else None,
        "marks": marks,
        **cache_counters(),
    }), flush=True)


if __name__ == "__main__":
    main()
