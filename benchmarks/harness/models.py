"""Small models for compile benchmarks, tests and the demo: same code everywhere.

Sizes are chosen so a CPU compile takes seconds, not minutes, while the graphs stay
representative: an MLP, a transformer encoder, a DLRM-like recommender (the workload of
Meta's effective-training-time report) and a small convolutional net.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Transformer(nn.Module):
    """Embedding + 2 encoder layers, seq 128, d 256."""

    def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 2, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=2 * d, batch_first=True,
                                           dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class DLRM(nn.Module):
    """EmbeddingBag tables, bottom MLP, pairwise dot interaction, top MLP."""

    def __init__(self, dense: int = 13, tables: int = 8, rows: int = 1000, d: int = 32) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 64), nn.ReLU(), nn.Linear(64, d), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum") for _ in range(tables))
        n = tables + 1
        self.top = nn.Sequential(nn.Linear(n * (n - 1) // 2 + d, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        feats = [x] + [t(sparse[:, i, :]) for i, t in enumerate(self.tables)]
        z = torch.stack(feats, dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def _classify(batch: int, make_input: Callable[[int], tuple[torch.Tensor, ...]]
              ) -> Callable[[int], Batch]:
    return lambda b: (make_input(b or batch), torch.randint(0, 10, (b or batch,)))


class GPT2(nn.Module):
    """A third-party model: Hugging Face transformers' GPT-2, built from a config in code (no
    hub download), 2 layers, d 128, seq 64; the logits of the last position classify."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64,
                            bos_token_id=0, eos_token_id=0, use_cache=False)
        self.lm = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens).logits[:, -1, :]


Model = tuple[nn.Module, Callable[[int], Batch], Callable[..., torch.Tensor]]


def build(name: str, device: str = "cpu") -> Model:
    """(model, make_batch(batch_size or 0 for the default), loss_fn) for a model name, the
    model's parameters and every batch on `device` (`cpu`, `cuda`)."""
    model, make_batch, loss_fn = _build(name)
    if device == "cpu":
        return model, make_batch, loss_fn

    def on_device(b: int) -> Batch:
        inputs, target = make_batch(b)  # made on the CPU: the same numbers on any device
        return tuple(t.to(device) for t in inputs), target.to(device)

    return model.to(device), on_device, loss_fn


def _build(name: str) -> Model:
    torch.manual_seed(0)
    ce = nn.functional.cross_entropy
    if name == "mlp":
        return MLP(), _classify(32, lambda b: (torch.randn(b, 64),)), ce
    if name == "transformer":
        return Transformer(), _classify(8, lambda b: (torch.randint(0, 1000, (b, 128)),)), ce
    if name == "conv":
        return ConvNet(), _classify(8, lambda b: (torch.randn(b, 3, 32, 32),)), ce
    if name == "dlrm":
        def dlrm_batch(b: int) -> Batch:
            b = b or 64
            inputs = (torch.randn(b, 13), torch.randint(0, 1000, (b, 8, 4)))
            return inputs, torch.rand(b)
        return DLRM(), dlrm_batch, nn.functional.binary_cross_entropy_with_logits
    if name == "gpt2":
        batch = _classify(8, lambda b: (torch.randint(0, 1000, (b, 64)),))
        return GPT2(), lambda b: (batch(b)[0], torch.randint(0, 1000, (b or 8,))), ce
    raise ValueError(f"unknown model {name!r}: {', '.join(MODELS)}")


MODELS = ("mlp", "transformer", "dlrm", "conv", "gpt2")
"""gpt2 needs `transformers` (the [dev] extra; gpu_check.sh installs it)."""
