"""A process that compiles some of two functions under one fingerprint, for republish tests.

    python tests/republish_job.py f,g

megacache is enabled explicitly with a fixed model name and code, so every run shares one
key whichever functions it compiles. Prints one JSON line: the results, torch's cache
counters and the session's load, publish and event fields.
"""

from __future__ import annotations

import json
import sys

import torch

import megacache_client
from megacache_client.torch import env as torch_env
from megacache_client.torch import precompile

SESSION = megacache_client.enable(model="republish", code="c1")


def f(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2 + 1).sum()


def g(x: torch.Tensor) -> torch.Tensor:
    return (x.cos() - x).abs().mean()


def main() -> None:
    chosen = {"f": f, "g": g}
    x = torch.linspace(0, 1, 64)
    results = {name: float(torch.compile(chosen[name])(x)) for name in sys.argv[1].split(",")}
    SESSION.close()
    event = SESSION.event()
    print(json.dumps({
        "results": results, "counters": torch_env.cache_counters(),
        "precompile": precompile.counters(), "outcome": event.outcome if event else None,
        "reason": event.reason if event else None,
        "published": SESSION.publish_result.published,
        "publish_reason": SESSION.publish_result.reason,
        "reported": SESSION.load_result.reported,
        "artifact_counts": SESSION.load_result.entry.artifact_counts
        if SESSION.load_result.entry else None,
    }), flush=True)


if __name__ == "__main__":
    main()
