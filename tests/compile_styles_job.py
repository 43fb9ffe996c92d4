"""A training process that compiles in every way people do, for the fingerprint e2e test.

Two different models through `nn.Module.compile()` (torch.compile sees `_call_impl`, a bound
method), an EMA copy of the first (same class and code: same key), a loss under
`@torch.compile(fullgraph=True)` and a plain function with `torch.compile(fn, dynamic=False)`.
megacache is enabled without a model name or code, so every name and code id is derived.
Prints one JSON line: the tracks (one per fingerprint) and torch's cache counters.
"""

from __future__ import annotations

import copy
import json

import torch
from torch import nn

import megacache_client
from megacache_client.torch import env as torch_env

SESSION = megacache_client.enable()  # before the decorator below runs, as autoload would be


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * 2


@torch.compile(fullgraph=True)
def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).mean()


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 + 1


def main() -> None:
    torch.manual_seed(0)
    model, tower = MLP(), Tower()
    ema = copy.deepcopy(model)
    model.compile()
    tower.compile()
    ema.compile()
    scaled = torch.compile(scale, dynamic=False)
    opt = torch.optim.SGD(list(model.parameters()) + list(tower.parameters()), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(2):
        loss = loss_fn(tower(model(x)), scaled(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ema(x)
    SESSION.close()
    tracks = [{"model": t.fp.model, "code": t.fp.code, "config": t.fp.config, "key": key,
               "outcome": t.load.outcome, "reason": t.load.reason,
               "published": t.publish.published, "publish_reason": t.publish.reason}
              for key, t in SESSION.tracks.items()]
    print(json.dumps({"tracks": tracks, "counters": torch_env.cache_counters(),
                      "loss": float(loss)}), flush=True)


if __name__ == "__main__":
    main()
