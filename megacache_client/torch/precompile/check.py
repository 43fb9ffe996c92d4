"""The child process that checks precompiled Dynamo output before its entry calls it verified.

`python -m megacache_client.torch.precompile.check <job> <verdicts>` runs in a process that
never traced anything, as a new machine is: for each precompile artifact of the job
(`verify.write_job`) it

1. unpickles the artifact and checks it was made by this torch and Python;
2. refuses an entry with no compiled code that torch did not leave out (bypass), and any
   compiled code whose guards were not saved (torch 2.13 leaves an empty
   state where it could not save them: such an entry is what crashed T5's cold run);
3. for code of an importable module (a library's, as Hugging Face's modeling files),
   imports that module afresh, rebuilds its guards there as `CompilePackage.install` does,
   and checks that every global its bytecode loads would be defined (the check that
   catches ResNet's missing module alias). The trainer's own script cannot be imported
   without running it: for its code the publisher's in-process `precompile.unrestorable`
   stands;
4. rebuilds each compiled graph from the artifact alone, as a new machine does, calls it
   on inputs of the shapes and dtypes recorded when it was traced (random floats, zero
   integers, with a fixed seed) and compares its outputs with the traced FX graph run
   eagerly on the same inputs: within tolerance for values; shapes and dtypes only for a
   graph with random ops (dropout), whose values no two implementations share.

It writes one verdict per artifact key: "" for verified, else why not. Anything it raises
or a timeout leaves the artifact unverified; the publisher decides that, not this process.
"""

from __future__ import annotations

import importlib
import json
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

SCRIPT_MODULES = ("__main__", "__mp_main__")
RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal", "uniform", "multinomial")
RTOL = 1e-3
ATOL = 1e-3
"""Relative to the largest magnitude of the reference output: Inductor reorders float sums."""


def check_artifact(content: bytes, graphs: dict[str, Any]) -> str:
    """Why this precompile artifact is not verified ("" = verified)."""
    entry = pickle.loads(content)
    entry.dynamo.check_versions()
    if not any(c.guarded_codes for c in entry.dynamo.codes if not c.bypassed):
        return "it holds no precompiled code (torch left every frame out)"
    for code in entry.dynamo.codes:
        if code.bypassed:
            continue  # compiled as usual by every process
        if any(not g.guards_state for g in code.guarded_codes):
            return f"torch could not save the guards of {code.python_code.co_name}"
        if code.python_module not in SCRIPT_MODULES:
            build_guards(code)
    missing = _missing_here([c for c in entry.dynamo.codes
                             if c.python_module not in SCRIPT_MODULES])
    if missing:
        return f"its bytecode loads {', '.join(missing[:3])}, undefined in a new process"
    for backend_id, backend in entry.backends.items():
        why = check_graph(backend_id, backend, graphs.get(backend_id))
        if why:
            return why
    return ""


def build_guards(code: Any) -> None:
    """Rebuild each guard of a library module's code as `CompilePackage.install` does on a
    new machine: unpickled, then made into a guard manager over the freshly imported
    module's globals (a guard that cannot be rebuilt there fails the entry here, not in a
    consumer's `torch.compile`: seen with GPT-2, `'_Missing' object has no attribute
    '__name__'`)."""
    import torch
    from torch._dynamo.output_graph import get_builtins_dict
    from torch._dynamo.package import (
        SerializedCode,
        _lookup_code,
        load_guard_manager,
        load_guards_state,
    )

    scope = vars(importlib.import_module(code.python_module))
    target = _lookup_code(code) if code.code_source \
        else SerializedCode.to_code_object(code.python_code)
    for guarded in code.guarded_codes:
        state = load_guards_state(guarded.guards_state)
        if not isinstance(state, torch._dynamo.guards.GuardsState):
            raise TypeError(f"guards of {code.python_code.co_name} are a {type(state)}")
        builtins_name = state.output_graph.name_of_builtins_dict_key_in_fglobals
        if builtins_name and builtins_name not in scope:
            scope[builtins_name] = get_builtins_dict(scope)
        load_guard_manager(state, target, scope)


def _missing_here(codes: list[Any]) -> list[str]:
    import builtins

    from megacache_client.torch.precompile import _missing_globals

    return _missing_globals(codes, sys.modules, vars(builtins))


def check_graph(backend_id: str, backend: Any, traced: Any) -> str:
    """Why the precompiled graph `backend_id` is not verified ("" = it matches its trace)."""
    import torch

    if traced is None:
        return f"{backend_id}: its traced graph was not recorded (nothing to compare with)"
    graph_bytes, specs, grad = traced
    gm = pickle.loads(graph_bytes)
    compiled = backend.after_deserialization()
    torch.manual_seed(0)
    inputs = [_make(spec) for spec in specs]
    with torch.set_grad_enabled(grad):
        with torch.random.fork_rng(devices=[]):
            expected = _flat(gm(*_clones(inputs)))
        got = _flat(compiled(*_clones(inputs)))
    if len(got) != len(expected):
        return f"{backend_id}: {len(got)} outputs, the traced graph gives {len(expected)}"
    values = not _has_random_ops(gm)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        why = _compare(g, e, values)
        if why:
            return f"{backend_id}: output {i} {why}"
    return ""


def _make(spec: Any) -> Any:
    import torch

    if spec[0] == "int":
        return spec[1]
    _, shape, stride, dtype_name, device, requires_grad = spec
    dtype = getattr(torch, dtype_name)
    base = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        with torch.no_grad():
            base.copy_(torch.randn(shape, dtype=dtype, device=device))
    else:
        base.zero_()
    return base.requires_grad_(requires_grad)


def _clones(inputs: list[Any]) -> list[Any]:
    """Fresh copies (same strides), so an in-place update by one call (a BatchNorm's running
    stats) cannot feed the other."""
    import torch

    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            copy = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
            with torch.no_grad():
                copy.copy_(x)
            x = copy.requires_grad_(x.requires_grad)
        out.append(x)
    return out


def _flat(outputs: Any) -> list[Any]:
    import torch

    items = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in items]


def _has_random_ops(gm: Any) -> bool:
    return any(n.op in ("call_function", "call_method")
               and any(r in str(n.target).lower() for r in RANDOM_OPS)
               for n in gm.graph.nodes)


def _compare(got: Any, expected: Any, values: bool) -> str:
    import torch

    if not isinstance(expected, torch.Tensor):
        return "" if got == expected else f"is {got!r}, the traced graph gives {expected!r}"
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape \
            or got.dtype != expected.dtype:
        return (f"is {_describe(got)}, the traced graph gives {_describe(expected)}")
    if not values or expected.numel() == 0:
        return ""
    if not (expected.dtype.is_floating_point or expected.dtype.is_complex):
        return "" if torch.equal(got, expected) else "differs from the traced graph's"
    scale = float(expected.abs().nan_to_num(0.0).max()) if expected.numel() else 0.0
    close = torch.isclose(got, expected, rtol=RTOL, atol=ATOL * max(scale, 1.0),
                          equal_nan=True)
    if bool(close.all()):
        return ""
    worst = float((got - expected).abs().nan_to_num(float("inf")).max())
    return f"differs from the traced graph's by up to {worst:.3g} (scale {scale:.3g})"


def _describe(x: Any) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).removeprefix('torch.')} tensor of shape {list(x.shape)}"
    return type(x).__name__


def main(argv: list[str]) -> int:
    """Check every artifact of the job file; write {key: verdict} as JSON."""
    with open(argv[1], "rb") as f:
        job = pickle.load(f)
    verdicts: dict[str, str] = {}
    for key, content in job["artifacts"]:
        try:
            verdicts[key] = check_artifact(content, job["graphs"])
        except Exception as exc:  # noqa: BLE001 - any failure is a reason to refuse
            where = traceback.extract_tb(exc.__traceback__)[-1]
            verdicts[key] = (f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:"
                             f"{where.lineno})")[:300]
    with open(argv[2], "w") as f:
        json.dump(verdicts, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
