"""The client's layers, as its folders show them, never imported upward.

From the bottom: the wire contract (`wire/`, shared with the server); the errors and the
records the steps pass on (`errors`, `results`); the settings (`config`); the job's identity
(`job/`); torch's side (`torch/`); the network, the node's disk cache and the trust gate
(`transport/`); the lifecycle's steps (`steps/`); Effective Training Time (`ett/`); the
publisher and the session that runs the steps (`publisher`, `lifecycle`); the public API
(`api`), the command (`cli/`) and the package root. A module imports from its own layer or
below, at import time or lazily, for types too: the hook knows the session only by a
protocol (`torch/hook.py`), the gate's records live in `results.py`.
"""

from __future__ import annotations

from pathlib import Path

from layers import import_cycles, imports, module_name

CLIENT = Path(__file__).resolve().parent.parent / "megacache_client"

RANK = {"wire": 0, "__version__": 0, "errors": 1, "results": 1, "config": 2, "job": 3,
        "torch": 4, "transport": 5, "steps": 6, "ett": 7, "publisher": 8, "lifecycle": 9,
        "api": 10, "cli": 11, "": 12}
"""A module may import from its own rank or below."""


def _rank(module: str) -> int:
    return RANK[module.split(".")[1] if "." in module else ""]


def test_every_part_of_the_client_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in CLIENT.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert parts <= set(RANK), sorted(parts - set(RANK))


def test_no_import_runs_upward() -> None:
    upward = [f"{module} imports {name}"
              for path in sorted(CLIENT.rglob("*.py"))
              for module in [module_name(path, CLIENT)]
              for name in imports(path, top_level_only=False)
              if name.split(".")[0] == "megacache_client" and _rank(name) > _rank(module)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles() -> None:
    cycles = import_cycles(CLIENT)
    assert not cycles, "\n".join(cycles)
