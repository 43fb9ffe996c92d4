"""Precompiled Dynamo in the bundle: switch torch's caching precompile on, gate its use.

With `torch._dynamo.config.caching_precompile = True` (torch >= 2.8), a process records what
Dynamo produced (bytecode, guards, the compiled graphs it calls) and
`torch.compiler.save_cache_artifacts()` returns it as `precompile` artifacts. A process that
loads them skips Dynamo tracing: its first compiled step is a guard check and a call.

Those artifacts are keyed by torch only by the compiled function's qualified name and first
line (`torch._dynamo.package.CompilePackage.source_id_from_fn`), and torch itself drops
ID_MATCH guards while they are recorded, so using one made for another model, other code or
other compile options could run a wrong graph. The consumer therefore loads them only from
an entry of its *exact* fingerprint (same model, code, env, hw, compile config) whose
producer ran the same torch and Python; anything else is refused with a reason and the run
compiles Dynamo as usual. Guards that fail on the consumer (other shapes, grad mode, ...)
make Dynamo recompile normally: the precompiled entry is one more cache entry, not a bypass.

One torch 2.13 defect needs a hand: the globals a precompiled entry installs (its builtins
dict, `__builtins_dict___0`, ...) are named by the *producer's* process-wide unique-id
counter, while a fresh consumer's counter starts at 0 again, so its first recompile (after
a guard failure) picks the same name and Dynamo raises "Name '__builtins_dict___0' already
exists in scope". The producer records its counter's high-water mark with the bundle and
the consumer moves its own counter past it before the entry is installed.

torch also keeps precompiled entries on local disk (`<inductor cache>/dynamo/<key>`, written
by `save_cache_artifacts` and by loading a bundle) under that same weak key, where any later
process on the node with caching precompile on would pick them up, whatever its model. The
client removes the entries its process wrote or loaded when it closes, so only its gated
path ever hands precompiled Dynamo output to torch.
"""

from __future__ import annotations

import itertools
import logging
import platform
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megacache_client import torch_env
from megacache_client.config import ClientConfig
from megacache_client.manifest import BlobRef

log = logging.getLogger("megacache")

ARTIFACT_TYPE = "precompile"
META_TORCH = "precompile_torch"
META_PYTHON = "precompile_python"
META_IDS = "precompile_unique_ids"
MAX_IDS = 10**9


def supported() -> bool:
    """True when this torch has caching precompile (a config flag + the precompile context)."""
    try:
        import torch._dynamo.precompile_context  # noqa: F401

        return hasattr(torch_env.torch_module()._dynamo.config, "caching_precompile")
    except Exception:
        return False


def turn_on(config: ClientConfig) -> str:
    """Switch caching precompile on for this process when allowed; returns why not ("" = on).

    Must run before the first torch.compile call: torch creates the package that records
    Dynamo's output when `torch.compile` wraps the module.
    """
    if not config.precompile:
        return "precompiled Dynamo off (MEGACACHE_PRECOMPILE=0)"
    if not supported():
        return f"torch {torch_env.torch_version()} has no caching precompile"
    torch_env.torch_module()._dynamo.config.caching_precompile = True
    return ""


def enabled() -> bool:
    """Whether this process records and accepts precompiled Dynamo output right now."""
    try:
        return bool(torch_env.torch_module()._dynamo.config.caching_precompile)
    except Exception:
        return False


def producer_meta(counts: dict[str, int]) -> dict[str, str]:
    """What the bundle blob records about its precompile artifacts, for consumers to check."""
    if not counts.get(ARTIFACT_TYPE):
        return {}
    from torch._dynamo import bytecode_transformation

    high_water = next(bytecode_transformation._unique_id_counter)
    return {META_TORCH: torch_env.torch_version(), META_PYTHON: platform.python_version(),
            META_IDS: str(high_water)}


def refusal(outcome: str | None, bundle: BlobRef) -> str:
    """Why this run must not load the entry's precompile artifacts ("" = it may).

    `outcome` is the lookup's: only an exact fingerprint hit may use them; a fallback entry
    is another model's code or compile options by construction. The caller drops the
    artifacts when this is not empty (and reports it only when the bundle had some).
    """
    if not enabled():
        return "precompile is off in this process"
    if outcome != "hit":
        return (f"entry is a {outcome} for this fingerprint (other code or options): "
                "its precompiled Dynamo output could run a wrong graph here")
    theirs = (bundle.meta.get(META_TORCH), bundle.meta.get(META_PYTHON))
    ours = (torch_env.torch_version(), platform.python_version())
    if theirs[0] is None or theirs[1] is None:
        return "entry does not record which torch and Python made its precompile artifacts"
    if theirs != ours:
        return (f"precompile artifacts made by torch {theirs[0]} / Python {theirs[1]}, this "
                f"process runs torch {ours[0]} / Python {ours[1]}")
    ids = bundle.meta.get(META_IDS, "")
    if not ids.isdigit() or int(ids) > MAX_IDS:
        return "entry does not record the producer's Dynamo unique-id counter"
    return ""


def reserve_ids(bundle: BlobRef) -> None:
    """Move Dynamo's unique-id counter past every name the producer's entries may install.

    Call before the precompiled entries are installed (at the latest, before the first
    recompile); `refusal` has checked the recorded value.
    """
    from torch._dynamo import bytecode_transformation

    floor = int(bundle.meta[META_IDS])
    current = next(bytecode_transformation._unique_id_counter)
    bytecode_transformation._unique_id_counter = itertools.count(max(current, floor))


def forget_local(loaded: Iterable[str]) -> int:
    """Remove this process's precompiled entries from torch's on-disk Dynamo cache.

    `loaded` are the precompile keys this process loaded from a bundle; the ones it recorded
    itself come from torch's precompile context. Returns how many entries were removed.
    """
    from torch._dynamo.package import DynamoCache
    from torch._dynamo.precompile_context import PrecompileContext

    root = Path(DynamoCache.path_prefix())
    removed = 0
    for key in set(loaded) | set(PrecompileContext._dynamo_cache_entries):
        path = root / key
        if re.fullmatch(r"[0-9a-f]{64}", key) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def counters() -> dict[str, int]:
    """torch's own precompile cache counters in this process (loads from its Dynamo cache)."""
    try:
        from torch._dynamo.utils import counters as torch_counters
    except Exception:
        return {"hit": 0, "miss": 0, "error": 0}
    c: Any = torch_counters["dynamo_cache"]
    return {"hit": int(c["dynamo_cache_hit"]), "miss": int(c["dynamo_cache_miss"]),
            "error": int(c["dynamo_cache_error"])}
