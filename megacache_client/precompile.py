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
from collections.abc import Callable, Iterable
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
        return "precompiled Dynamo off (MEGACACHE_PRECOMPILE=0, the default; 1 turns it on)"
    if not supported():
        return f"torch {torch_env.torch_version()} has no caching precompile"
    if not tolerate_unresolvable_frames():
        return (f"torch {torch_env.torch_version()}: its precompile package cannot be made "
                "to skip frames it cannot name, which would crash the trainer")
    torch_env.torch_module()._dynamo.config.caching_precompile = True
    stabilize_autograd_keys()
    return ""


def tolerate_unresolvable_frames() -> bool:
    """Make a frame torch cannot name in a precompile package a bypassed entry, not a crash.

    With caching precompile on, torch 2.13 records every frame Dynamo compiles under a name
    it can import again; for some it finds none (a function reached through a property, as
    Hugging Face's `loss_function`) and raises PackageError out of the training step. torch
    already has the notion this needs: a bypassed entry is kept out of the package and
    compiled as usual by every process. Returns whether the patch is in place.
    """
    try:
        import inspect

        from torch._dynamo.exc import PackageError
        from torch._dynamo.package import CompilePackage
    except Exception:
        return False
    if not hasattr(CompilePackage, "_add_function"):
        return False

    def tolerant(add: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def add_or_bypass(self: Any, code: Any) -> None:
            try:
                add(self, code)
            except PackageError as exc:
                module = inspect.getmodule(code)
                self._add_function(code, module.__name__ if module else code.co_filename)
                self._codes[code].bypassed = True
                log.info("megacache: frame %s left out of precompiled Dynamo output: %s",
                         getattr(code, "co_qualname", code.co_name), exc)

        return add_or_bypass

    return _patch_once(CompilePackage, "_add_user_function", tolerant)


def stabilize_autograd_keys() -> bool:
    """Keep AOTAutograd's cache keys the same from one process to the next.

    With caching precompile on, torch 2.13 puts the graph's precompile backend id into the
    AOTAutograd cache key, and that id holds a fresh uuid in every process
    (`unique_id("__compiled_fn", with_uuid=True)`): every AOTAutograd lookup of a frame not
    served by a precompiled package then misses (a fallback entry, a failed guard), and each
    run records artifacts under new keys, so it publishes again. torch itself stores the
    entry without the id and re-binds a hit to the new run's id, so the key is computed here
    as if the id were unset. Returns whether the patch is in place.
    """
    try:
        import dataclasses

        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler
    except Exception:
        return False

    def without_backend_id(reduce: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def reduce_without_backend_id(self: Any, aot_config: Any) -> Any:
            if getattr(aot_config, "precompile_backend_id", None) is not None:
                aot_config = dataclasses.replace(aot_config, precompile_backend_id=None)
            return reduce(self, aot_config)

        return reduce_without_backend_id

    return _patch_once(AOTAutogradCachePickler, "_reduce_aot_config", without_backend_id)


def _patch_once(owner: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace `owner.name` by `wrap(owner.name)`, once per process (the wrapper is marked)."""
    current = getattr(owner, name)
    if not getattr(current, "_megacache_patch", False):
        patched = wrap(current)
        patched._megacache_patch = True
        setattr(owner, name, patched)
    return True


def enabled() -> bool:
    """Whether this process records and accepts precompiled Dynamo output right now."""
    try:
        return bool(torch_env.torch_module()._dynamo.config.caching_precompile)
    except Exception:
        return False


def source_id(target: Any) -> tuple[str, str] | None:
    """(torch's precompile key of what `torch.compile(target)` wraps, its readable name), or
    None when precompile is off here. torch keys a precompiled package by the wrapped
    function's qualified name and first line: every `nn.Module.compile()` wraps
    `Module._call_impl`, and a module and its EMA copy wrap the same `forward`."""
    if not enabled():
        return None
    try:
        import torch
        from torch._dynamo.eval_frame import innermost_fn
        from torch._dynamo.package import CompilePackage

        fn = target.forward if isinstance(target, torch.nn.Module) else target
        inner = innermost_fn(fn)
        return CompilePackage.source_id_from_fn(fn), str(inner.__qualname__)
    except Exception:
        return None


def shared_key(compiled: dict[str, list[str]]) -> str:
    """Why this process's precompiled Dynamo output must not be shipped ("" = it may).

    `compiled` maps each precompile key to the names of the callables wrapped under it.
    torch keeps one package per key, so when several callables share one, each wrapper's
    entries overwrite the others': a consumer would load a package that fits one of them,
    recompile the rest and publish again on every start (seen with two `.compile()`d
    models and an EMA copy). Such a process ships everything but its Dynamo output.
    """
    for names in compiled.values():
        if len(names) > 1:
            return (f"{len(names)} compiled callables share torch's precompile key of "
                    f"{names[0]}: precompiled Dynamo output not shipped")
    return ""


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


def forget_package_of(target: Any) -> bool:
    """Remove the precompiled package `torch.compile(target)` would load from local disk;
    True if there was one. For a package that fails to install: torch's own fallback
    (compile afresh) is broken in 2.13 when installation fails after its sources checked
    out ("CompilePackage is already initialized"), so the hook compiles again without it."""
    found = source_id(target)
    if found is None:
        return False
    from torch._dynamo.package import DynamoCache

    path = Path(DynamoCache.path_prefix()) / found[0]
    if not path.is_dir():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


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
