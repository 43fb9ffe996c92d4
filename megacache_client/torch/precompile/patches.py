"""The patches precompiled Dynamo needs in torch before it can be trusted on a new machine.

Each function patches one torch internal once (`_patch_once`) and returns whether the patch
is in place; `precompile.turn_on` switches caching precompile on only when every patch it
needs is. They live apart from the gating rules in `precompile/__init__.py` because they are what
changes with each torch release: a torch upgrade reads this file first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("megacache")


def record_module_aliases() -> bool:
    """Make the precompile package record every module alias Dynamo's bytecode loads.

    Dynamo loads a module its output needs (`collections`, to rebuild a Hugging Face
    `ModelOutput`) through a global it installs under the module's last name and the
    producer's object id (`PyCodegen.create_load_python_module`: `___module_collections_
    <id>_c0`). torch 2.13's package records only the aliases of `import` statements
    (`CompilePackage.add_import_source`), so a consumer installs the bytecode without that
    global and the first step raises NameError. Recording the alias with the module's name
    lets `CompilePackage.install` import and install it like any other. Returns whether the
    patch is in place.
    """
    try:
        from torch._dynamo.codegen import PyCodegen
    except Exception:
        return False
    if not hasattr(PyCodegen, "create_load_python_module"):
        return False

    def recording(create: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def create_and_record(self: Any, mod: Any) -> Any:
            instruction = create(self, mod)
            package = getattr(self.tx.output, "package", None)
            alias = getattr(instruction, "argval", None)
            if package is not None and isinstance(alias, str) \
                    and alias.startswith("___module_") and importable(mod):
                package.add_import_source(alias, mod.__name__)
            return instruction

        return create_and_record

    return _patch_once(PyCodegen, "create_load_python_module", recording)


_INSTALLED: set[str] = set()
"""Every global Dynamo installed in this process's module scopes (names of its own making)."""


def record_installed_globals() -> bool:
    """Note the name of every global Dynamo installs, so a check of its precompiled output
    can tell a global of its own making (which a new machine has only if the package
    installs it) from one the user's module defines. Returns whether the patch is in place."""
    try:
        from torch._dynamo.output_graph import OutputGraph
    except Exception:
        return False
    if not hasattr(OutputGraph, "install_global_unsafe"):
        return False

    def recording(install: Callable[[Any, str, Any], None]) -> Callable[[Any, str, Any], None]:
        def install_and_record(self: Any, name: str, value: Any) -> None:
            install(self, name, value)
            _INSTALLED.add(name)

        return install_and_record

    return _patch_once(OutputGraph, "install_global_unsafe", recording)


_SERVED = [0]
"""Calls of compiled graphs that precompiled Dynamo entries installed, in this process."""


def count_served_graphs() -> bool:
    """Count the calls of every graph a precompiled entry installs.

    torch's own `dynamo_cache_hit` counts packages installed, not used: when the entry's
    guards fail (other shapes), Dynamo traces anew and the package served nothing. A call
    of an installed graph is the proof that precompiled output ran, which the inert-bundle
    check needs. Returns whether the patch is in place.
    """
    try:
        import torch
        from torch._dynamo.package import CompilePackage
    except Exception:
        return False
    if not hasattr(CompilePackage, "_install_global"):
        return False

    def counting(install: Callable[[Any, Any, str, Any], None]
                 ) -> Callable[[Any, Any, str, Any], None]:
        def install_counted(self: Any, module: Any, name: str, value: Any) -> None:
            if name.startswith("__compiled_fn") and callable(value):
                graph = value

                def served(*args: Any, **kwargs: Any) -> Any:
                    _SERVED[0] += 1
                    return graph(*args, **kwargs)

                value = torch._dynamo.disable(served)
            install(self, module, name, value)

        return install_counted

    return _patch_once(CompilePackage, "_install_global", counting)


def importable(module: Any) -> bool:
    """Whether `import module.__name__` in a fresh process gives this very module."""
    import sys

    name = getattr(module, "__name__", None)
    return isinstance(name, str) and sys.modules.get(name) is module


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


def tolerate_unsaveable_guards() -> bool:
    """Make a frame whose guards torch cannot save a bypassed entry, not a crash.

    When saving a frame's guards fails, torch 2.13 bypasses the frame's package entry (as it
    means to) but then asserts that the guards were saved (`convert_frame._compile_inner`:
    "check_fn.guards_state must not be None"), raising out of the cold trainer's step (seen
    with Hugging Face's T5). An empty state lets it go on: `add_guarded_code` returns before
    reading it for a bypassed entry. Returns whether the patch is in place.
    """
    try:
        from torch._dynamo.guards import CheckFunctionManager
    except Exception:
        return False

    def tolerant(init: Callable[..., None]) -> Callable[..., None]:
        def init_or_bypass(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            graph = kwargs.get("output_graph", args[1] if len(args) > 1 else None)
            if kwargs.get("save_guards") and getattr(self, "guards_state", 0) is None \
                    and getattr(graph, "package", 0) is None:
                self.guards_state = b""

        return init_or_bypass

    return _patch_once(CheckFunctionManager, "__init__", tolerant)


LOCAL_TYPE_ERROR = "cannot be saved into torch.compile() package"
"""What torch 2.13 says (a TypeError) when a guard checks an object of a class defined in a
local scope."""


def tolerate_local_types_in_guards() -> bool:
    """Make a frame whose guards check an object of a locally defined class a bypassed
    entry, not a crash.

    torch 2.13 bypasses the package entry of a frame with a guard it cannot save (it raises
    PackageError, which `CheckFunctionManager.__init__` catches), except for a type check on
    a class defined in a function: that raises TypeError, out of the cold trainer's first
    step (transformers 5.25's Llama builds such a class in `_create_func_module`). Raising
    it as the PackageError it stands for lets torch bypass the entry as it means to.
    Returns whether the patch is in place.
    """
    try:
        from torch._dynamo.exc import PackageError
        from torch._dynamo.guards import CheckFunctionManager
    except Exception:
        return False
    if not hasattr(CheckFunctionManager, "serialize_guards"):
        return False

    def tolerant(serialize: Callable[..., bytes]) -> Callable[..., bytes]:
        def serialize_or_bypass(self: Any, *args: Any, **kwargs: Any) -> bytes:
            try:
                return serialize(self, *args, **kwargs)
            except TypeError as exc:
                if LOCAL_TYPE_ERROR not in str(exc):
                    raise
                raise PackageError(str(exc)) from exc

        return serialize_or_bypass

    return _patch_once(CheckFunctionManager, "serialize_guards", tolerant)


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




_PENDING: list[tuple[bytes, list[Any], bool] | None] = [None]
CAPTURED: dict[str, tuple[bytes, list[Any], bool] | None] = {}
"""What each compiled graph of this process was traced as, by its precompile backend id:
the pickled FX graph Dynamo captured, its inputs' specs (`input_spec`) and whether grad
mode was on (a guard of the graph), None when the graph could not be pickled. The
publisher's check (`verify.py`) calls each precompiled graph on inputs of these
specs and compares it with this graph."""


def record_traced_graphs() -> bool:
    """Keep, for each graph Dynamo hands its backend, the graph and its inputs' specs.

    Taken before the backend runs (Inductor's passes rewrite the graph in place), and
    matched to the backend id the package records next (`add_backend_id`, under the same
    compile lock). Pickling a graph without parameters (Dynamo passes them as inputs)
    costs milliseconds of a compile that takes seconds. Returns whether the patch is in
    place."""
    try:
        import pickle

        import torch
        from torch._dynamo.output_graph import OutputGraph
        from torch._dynamo.package import CompilePackage
    except Exception:
        return False
    if not hasattr(OutputGraph, "call_user_compiler") \
            or not hasattr(CompilePackage, "add_backend_id"):
        return False

    def capturing(call: Callable[..., Any]) -> Callable[..., Any]:
        def call_and_capture(self: Any, gm: Any, example_inputs: Any) -> Any:
            _PENDING[0] = None
            if getattr(self, "package", None) is not None:
                try:
                    _PENDING[0] = (pickle.dumps(gm), [input_spec(x) for x in example_inputs],
                                   torch.is_grad_enabled())
                except Exception as exc:  # the check then calls it unverifiable
                    log.debug("megacache: traced graph not kept for the check: %s", exc)
            return call(self, gm, example_inputs)

        return call_and_capture

    def recording(add: Callable[..., None]) -> Callable[..., None]:
        def add_and_record(self: Any, backend_id: str, backend: Any = None) -> None:
            add(self, backend_id, backend)
            CAPTURED[backend_id] = _PENDING[0]
            _PENDING[0] = None

        return add_and_record

    return _patch_once(OutputGraph, "call_user_compiler", capturing) \
        and _patch_once(CompilePackage, "add_backend_id", recording)


def input_spec(value: Any) -> Any:
    """What a graph input was, to make one like it in another process: a tensor's
    (shape, stride, dtype, device, requires_grad) with symbolic sizes at their hints, an
    int as itself. Anything else raises (the graph is then not checked)."""
    import torch

    def hint(n: Any) -> int:
        return int(n) if isinstance(n, int) else int(n.node.hint)

    if isinstance(value, torch.Tensor):
        return ("tensor", [hint(s) for s in value.shape], [hint(s) for s in value.stride()],
                str(value.dtype).removeprefix("torch."), str(value.device),
                bool(value.requires_grad))
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return ("int", hint(value))
    raise TypeError(f"graph input of type {type(value).__name__}")
