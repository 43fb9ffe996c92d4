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

torch also keeps precompiled entries on local disk (`<inductor cache>/dynamo/<key>`) under
that same weak key, and installs any it finds there unchecked: the client points torch's
Dynamo cache at a directory of this process's own before switching caching precompile on
(`store.py`), so only its gated path ever hands precompiled Dynamo output to torch,
however the process ends.
"""

from __future__ import annotations

import itertools
import logging
import platform
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from megacache_client.config import ClientConfig
from megacache_client.torch import env as torch_env
from megacache_client.torch import megacache_io
from megacache_client.torch.precompile import store as dynamo_store
from megacache_client.torch.precompile.patches import (
    _INSTALLED,
    _SERVED,
    count_served_graphs,
    record_installed_globals,
    record_module_aliases,
    record_traced_graphs,
    stabilize_autograd_keys,
    tolerate_local_types_in_guards,
    tolerate_unresolvable_frames,
    tolerate_unsaveable_guards,
)
from megacache_client.torch.precompile.refusals import (  # noqa: F401  (the package's API)
    META_REFUSED,
    META_REFUSED_AT,
    refusal_meta,
    refused_by,
    refused_since,
)
from megacache_client.wire.manifest import BlobRef

log = logging.getLogger("megacache")

ARTIFACT_TYPE = "precompile"
META_TORCH = "precompile_torch"
META_PYTHON = "precompile_python"
META_IDS = "precompile_unique_ids"
META_VERIFIED = "precompile_verified"
"""The keys of the bundle's precompile artifacts its producer verified in a child process
(`verify.py`), comma-separated: a consumer loads no other."""
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
    if not tolerate_unresolvable_frames():
        return (f"torch {torch_env.torch_version()}: its precompile package cannot be made "
                "to skip frames it cannot name, which would crash the trainer")
    if not (record_module_aliases() and record_installed_globals() and count_served_graphs()
            and tolerate_unsaveable_guards() and tolerate_local_types_in_guards()
            and record_traced_graphs()):
        return (f"torch {torch_env.torch_version()}: its precompile package cannot be made "
                "to record the globals its bytecode loads, which would crash a new machine")
    try:
        dynamo_store.claim()
    except Exception as exc:
        return (f"torch {torch_env.torch_version()}: its precompiled Dynamo cache cannot be "
                f"given a directory of this process's own ({type(exc).__name__}: {exc}), "
                "and in torch's shared one a later process could load it unchecked")
    torch_env.torch_module()._dynamo.config.caching_precompile = True
    stabilize_autograd_keys()
    quiet_dropped_guards()
    return ""


DROPPED_GUARD = "is dropped with caching_precompile=True"


class _DroppedGuards(logging.Filter):
    """Keeps torch's "<guard> is dropped with caching_precompile=True" warnings (seven for
    a small MLP, on every cold compile) out of the trainer's log: they are torch's note that
    its precompiled entries guard less (the reason the client loads only verified entries
    of its exact fingerprint, docs/precompiled-dynamo.md), not something a trainer can act
    on. Said once, at INFO, with how many."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if DROPPED_GUARD not in record.getMessage():
                return True
        except Exception:
            return True
        self.dropped += 1
        if self.dropped == 1:
            log.info("megacache: torch drops some guards while it records precompiled Dynamo "
                     "output (\"... %s\"); the client loads only verified entries of the "
                     "exact fingerprint, and keeps those warnings out of this log",
                     DROPPED_GUARD)
        return False


def quiet_dropped_guards() -> None:
    """Install `_DroppedGuards` on torch's guard logger (once)."""
    guards = logging.getLogger("torch._dynamo.guards")
    if not any(isinstance(f, _DroppedGuards) for f in guards.filters):
        guards.addFilter(_DroppedGuards())


def unrestorable(artifacts: megacache_io.Artifacts) -> dict[str, list[str]]:
    """The precompile artifacts a fresh process could not run: key -> the globals their
    bytecode loads that nothing would put in place there.

    A precompiled entry is Dynamo's bytecode plus what `CompilePackage.install` puts in the
    frame's module scope before it runs: the recorded module aliases, resume functions and
    compiled graphs. Anything else the bytecode loads must be a builtin or a global the
    user's module defines itself. Any other name is one Dynamo made in the producer and
    torch did not record (a module alias before `record_module_aliases`, a weakref, a
    wrapper): installed as is, the entry raises NameError in the trainer's step. Used by the
    producer before it ships Dynamo output and by the consumer before it loads any.
    """
    import builtins
    import pickle
    import sys

    bad: dict[str, list[str]] = {}
    for artifact in artifacts.get(ARTIFACT_TYPE, []):
        try:
            codes = pickle.loads(artifact.content).dynamo.codes
            missing = _missing_globals(codes, sys.modules, vars(builtins))
        except Exception as exc:  # an entry that cannot be read cannot be checked
            missing = [f"(unreadable: {type(exc).__name__}: {exc})"]
        if missing:
            bad[artifact.key] = missing
    return bad


def for_loading(artifacts: megacache_io.Artifacts, outcome: str | None, bundle: BlobRef
                ) -> tuple[megacache_io.Artifacts, str]:
    """The artifacts this run may hand to torch, and why any precompiled ones were left out.

    All of them are left out where `refusal` says so; otherwise each entry the producer did
    not verify in its child-process check (`verify.py`: the bundle's meta names the
    verified ones; an older producer's name none), and each a fresh process could not run
    (`unrestorable`): a producer that did not check, or a torch that records less than
    this client expects, costs a Dynamo trace, never a crashed step.
    """
    if not artifacts.get(ARTIFACT_TYPE):
        return artifacts, ""
    refused = refusal(outcome, bundle)
    if refused:
        return megacache_io.without(artifacts, ARTIFACT_TYPE), \
            f"precompiled Dynamo output not loaded: {refused}"
    verified = set(bundle.meta.get(META_VERIFIED, "").split(","))
    unverified = {a.key for a in artifacts[ARTIFACT_TYPE] if a.key not in verified}
    note = ""
    if unverified:
        artifacts = megacache_io.without(artifacts, ARTIFACT_TYPE, unverified)
        n = len(unverified)
        note = (f"{n} precompiled Dynamo entr{'y' if n == 1 else 'ies'} not loaded: not "
                "verified by the producer (traced here instead)")
    bad = unrestorable(artifacts)
    if not bad:
        return artifacts, note
    return megacache_io.without(artifacts, ARTIFACT_TYPE, set(bad)), "; ".join(filter(None, (
        note, f"{len(bad)} precompiled Dynamo entr{'y' if len(bad) == 1 else 'ies'} not "
        f"loaded: {_names(bad)} would not be defined here")))


def for_shipping(artifacts: megacache_io.Artifacts, compiled: dict[str, list[str]]
                 ) -> tuple[megacache_io.Artifacts, str]:
    """The artifacts this process may publish, and why any precompiled ones were left out:
    all of them when compiled callables share a precompile key (`shared_key`), and each
    entry a new machine could not run (`unrestorable`)."""
    if not artifacts.get(ARTIFACT_TYPE):
        return artifacts, ""
    shared = shared_key(compiled)
    if shared:
        return megacache_io.without(artifacts, ARTIFACT_TYPE), shared
    bad = unrestorable(artifacts)
    if not bad:
        return artifacts, ""
    return megacache_io.without(artifacts, ARTIFACT_TYPE, set(bad)), (
        f"{len(bad)} precompiled Dynamo entr{'y' if len(bad) == 1 else 'ies'} not shipped: "
        f"{_names(bad)} would not be defined on a new machine")


def verified_for_shipping(artifacts: megacache_io.Artifacts, loaded: set[str], *,
                          refused_before: frozenset[str] = frozenset(), wait: bool = True,
                          on_verdicts: Callable[[], None] | None = None
                          ) -> tuple[megacache_io.Artifacts, str, frozenset[str]]:
    """The artifacts this process may publish now that its own precompile artifacts were
    put to the child-process check (`verify.py`), why any failed ("" = none), and
    the keys refused on the artifact itself (for the bundle's `META_REFUSED`).
    `loaded`: precompile keys this process loaded from a verified entry (not traced here,
    already verified by their producer, shipped again as they were). `refused_before`:
    keys the loaded entry's producer refused; traced again here they are left out without
    a check (a new machine's exit does not wait seconds for a child to say it again).
    Without `wait`, artifacts whose check is under way are left out for now, without a
    note: the round `on_verdicts` runs adds them once verified."""
    from megacache_client.torch.precompile import verify as precompile_verify

    own = [a for a in artifacts.get(ARTIFACT_TYPE, []) if a.key not in loaded]
    if not own:
        return artifacts, "", frozenset()
    known = {a.key: "its producer's check refused it" for a in own if a.key in refused_before}
    failed, pending = dict(known), frozenset[str]()
    unchecked = {ARTIFACT_TYPE: [a for a in own if a.key not in known]}
    if unchecked[ARTIFACT_TYPE]:
        verdicts = precompile_verify.check(unchecked, ARTIFACT_TYPE, wait=wait,
                                           on_verdicts=on_verdicts)
        failed |= verdicts.failed
        pending = verdicts.pending
    refused = frozenset(k for k, why in failed.items()
                        if k in known or precompile_verify.settled(why))
    left_out = set(failed) | pending
    if not left_out:
        return artifacts, "", refused
    kept = megacache_io.without(artifacts, ARTIFACT_TYPE, left_out)
    if not failed:
        return kept, "", refused
    n = len(failed)
    return kept, (f"{n} precompiled Dynamo entr{'y' if n == 1 else 'ies'} not verified, "
                  "not shipped: " + next(iter(failed.values()))), refused


def _names(bad: dict[str, list[str]]) -> str:
    names = sorted({n for missing in bad.values() for n in missing})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _missing_globals(codes: list[Any], modules: dict[str, Any], builtin: dict[str, Any]
                     ) -> list[str]:
    """The names the entry's bytecode loads that nothing would define where it runs.

    torch installs an entry's aliases, resume functions and graphs in the scope of its
    recorded module, but bytecode runs in the globals of the module that *defines* the
    code: a `functools.wraps` decorator (Hugging Face's `can_return_tuple`) copies the
    wrapped function's `__module__`, so the two differ. Each code's loads are checked
    against its defining module (found by file), the recorded one when that is unknown.
    """
    from torch._dynamo.package import SerializedCode

    by_file = {getattr(m, "__file__", None): name for name, m in list(modules.items())}
    restored: dict[str, set[str]] = {}
    for code in codes:
        names = restored.setdefault(code.python_module, set())
        names |= set(code.import_sources) | {str(b) for b in code.backend_ids}
        if code.install_to_global:
            names |= {str(f) for f in code.function_names}
    missing: list[str] = []
    for code in codes:
        if code.bypassed:
            continue
        home = _defining_module(code, modules, by_file)
        module = modules.get(home)
        if module is None:
            missing.append(f"(module {home} not imported)")
            continue
        scope = vars(module)
        for guarded in code.guarded_codes:
            for name in _global_loads(SerializedCode.to_code_object(guarded.dynamo_code)):
                if name in restored.get(home, ()) or name in builtin \
                        or name.startswith("__builtins_dict__"):
                    continue
                if name in scope and name not in _INSTALLED:
                    continue
                missing.append(name)
    return sorted(set(missing))


def _defining_module(code: Any, modules: dict[str, Any], by_file: dict[Any, str]) -> str:
    """The module whose globals the code runs in: the recorded one when its file is the
    code's (a script is both `__main__` and, once multiprocessing has run, `__mp_main__`),
    else whichever module was loaded from the code's file."""
    filename = code.python_code.co_filename
    recorded = modules.get(code.python_module)
    if recorded is not None and getattr(recorded, "__file__", None) == filename:
        return str(code.python_module)
    return by_file.get(filename) or str(code.python_module)


def _global_loads(code: Any) -> set[str]:
    """The names `code` (and the code objects nested in it) loads as globals."""
    import dis
    import types

    names = {str(i.argval) for i in dis.get_instructions(code)
             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_loads(const)
    return names


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


def producer_meta(artifacts: megacache_io.Artifacts, refused: Iterable[str] = (),
                  refused_at: float | None = None) -> dict[str, str]:
    """What the bundle blob records about its precompile artifacts, for consumers to check.
    Every precompile artifact a bundle holds is a verified one (`verified_for_shipping`
    leaves the others out; loaded ones were verified by their producer), so all are named
    verified; `refused` names those the check refused (`META_REFUSED`), first made
    `refused_at` (now; `refusals`: they expire)."""
    keys = sorted(a.key for a in artifacts.get(ARTIFACT_TYPE, []))
    gone = set(refused)
    said = refusal_meta(gone, _joined(sorted(gone), MAX_META), refused_at)
    if not keys:
        return said
    from torch._dynamo import bytecode_transformation

    high_water = next(bytecode_transformation._unique_id_counter)
    return {**said, META_TORCH: torch_env.torch_version(),
            META_PYTHON: platform.python_version(), META_IDS: str(high_water),
            META_VERIFIED: _joined(keys, MAX_META)}


MAX_META = 4096
"""The server's bound on one meta value: a key past it goes unnamed (so is not loaded)."""


def _joined(keys: list[str], limit: int) -> str:
    out = ""
    for key in keys:
        if len(out) + len(key) + 1 > limit:
            break
        out = f"{out},{key}" if out else key
    return out


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


def counters() -> dict[str, int]:
    """torch's own precompile cache counters in this process (loads from its Dynamo cache)."""
    try:
        from torch._dynamo.utils import counters as torch_counters
    except Exception:
        return {"hit": 0, "miss": 0, "error": 0, "served": _SERVED[0]}
    c: Any = torch_counters["dynamo_cache"]
    return {"hit": int(c["dynamo_cache_hit"]), "miss": int(c["dynamo_cache_miss"]),
            "error": int(c["dynamo_cache_error"]), "served": _SERVED[0]}
