"""The fingerprint: which bundle fits this compile, and how two fingerprints differ.

    key = sha256(canonical JSON of {format, namespace, model, code, env, hw, config})

- model + code: the user's names when given, else derived from what torch.compile was
  handed. That is not always the model: `nn.Module.compile()` hands torch.compile the bound
  method `module._call_impl`, a decorator hands it a function, a trainer may hand it
  `functools.partial(step, ...)`. `identity()` unwraps each to the object whose class (or
  function) and source name the model, so two models compiled with `.compile()` never share
  a key, and a change to a model's source changes its key.
- env, hw: what the compiled code depends on about the installation and the machine
  (`torch_env`), never which machine it is.
- config: the compile-relevant arguments of torch.compile (backend, mode, dynamic,
  fullgraph, inductor options) and the thread count.

Used by the session (one fingerprint per distinct compile in a process) and by
`megacache fingerprint`, which needs no server and no session.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass
from typing import Any

from megacache_client.steps.sources import class_source
from megacache_client.wire.manifest import Fingerprint, Scalar, canonical_json

COMPONENTS = ("namespace", "model", "code", "env", "hw", "config")
CALL_METHODS = ("_call_impl", "__call__", "_wrapped_call_impl")
"""Methods that *are* the module when compiled: `nn.Module.compile()` compiles `_call_impl`."""


@dataclass(frozen=True)
class Identity:
    """A compiled object's model name and a digest of the source that defines it."""

    name: str
    code: str


def compute(*, namespace: str = "default", target: Any = None,
            options: dict[str, Any] | None = None, model: str | None = None,
            code: str | None = None) -> Fingerprint:
    """The fingerprint of compiling `target` with `options` (names given by the user win)."""
    from megacache_client.torch import env as torch_env

    derived = identity(target) if target is not None and not (model and code) else None
    return Fingerprint(
        namespace=namespace,
        model=model or (derived.name if derived else "default"),
        code=code or (derived.code if derived else "unknown"),
        env=torch_env.env_component(),
        hw=torch_env.hw_component(),
        config=config_component(options),
    )


def identity(target: Any) -> Identity:
    """Name and code digest of what torch.compile was given, unwrapped to the real model."""
    import torch

    target = _unwrap(target)
    owner = getattr(target, "__self__", None)
    if inspect.ismethod(target) and owner is not None:
        method = target.__func__.__name__
        suffix = "" if isinstance(owner, torch.nn.Module) and method in CALL_METHODS \
            else "." + method
        if isinstance(owner, torch.nn.Module):
            return Identity(_short(type(_inner(owner))) + suffix, module_code(owner))
        return Identity(_short(type(owner)) + suffix, _code_of([type(owner)]))
    if isinstance(target, torch.nn.Module):
        return Identity(_short(type(_inner(target))), module_code(target))
    if inspect.isfunction(target) or inspect.isclass(target):
        return Identity(_short(target), _code_of([target]))
    return Identity(_short(type(target)), _code_of([type(target)]))  # a callable object


def module_code(module: Any) -> str:
    """Digest of the source of every non-torch class in a module tree, base classes included
    (a shared base class's forward is the model's code too)."""
    classes: dict[str, type] = {}
    for sub in module.modules():
        for cls in type(sub).__mro__:
            classes.setdefault(_qualname(cls), cls)
    return _code_of(list(classes.values()))


def config_component(options: dict[str, Any] | None) -> dict[str, Scalar]:
    """Compile-relevant settings: torch.compile arguments, threads, torch's cache tag."""
    from megacache_client.torch import env as torch_env

    torch = torch_env.torch_module()
    defaults = _compile_defaults()
    opts = {k: v for k, v in (options or {}).items()
            if k != "disable" and not (k in defaults and _same(v, defaults[k]))}
    backend = opts.pop("backend", "inductor")
    inductor_options = opts.pop("options", None)
    return {
        "backend": backend if isinstance(backend, str) else _qualname(backend),
        "mode": opts.pop("mode", None) or "default",
        "dynamic": _scalar(opts.pop("dynamic", None)),
        "fullgraph": bool(opts.pop("fullgraph", False)),
        "options": _digest(inductor_options) if inductor_options else None,
        "other": _digest(opts) if opts else None,
        "threads": torch.get_num_threads(),
        "cache_key_tag": str(getattr(torch.compiler.config, "cache_key_tag", "") or ""),
        # AOTAutograd bundles its entries differently with caching precompile on.
        "precompile": bool(getattr(torch._dynamo.config, "caching_precompile", False)),
    }


@functools.cache
def _compile_defaults() -> dict[str, Any]:
    """torch.compile's keyword defaults: an argument passed at its default (as the decorator
    form does for all of them) must give the same fingerprint as one left out."""
    import torch

    try:
        params = inspect.signature(torch.compile).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or (type(a) is type(b) and a == b))
    except Exception:
        return False


def differing(a: Fingerprint, b: Fingerprint) -> list[str]:
    """The names of the components in which two fingerprints differ."""
    return [name for name in COMPONENTS if getattr(a, name) != getattr(b, name)]


def describe(theirs: Fingerprint, ours: Fingerprint) -> str:
    """How a stored fingerprint differs from ours, down to the fields of each component."""
    parts = []
    for name in differing(theirs, ours):
        t, o = getattr(theirs, name), getattr(ours, name)
        if isinstance(t, dict) and isinstance(o, dict):
            keys = sorted(k for k in set(t) | set(o) if t.get(k) != o.get(k))
            detail = ", ".join(f"{k}: {t.get(k)!r} vs {o.get(k)!r}" for k in keys[:4])
            parts.append(f"{name} ({detail})")
        else:
            parts.append(f"{name} ({t!r} vs {o!r})")
    return "; ".join(parts) or "nothing (listing raced a write)"


def _unwrap(target: Any) -> Any:
    """Through the wrappers torch.compile may be handed: a compiled module, a partial,
    `functools.wraps` decorators."""
    for _ in range(16):
        if hasattr(target, "_orig_mod"):
            target = target._orig_mod
        elif isinstance(target, functools.partial):
            target = target.func
        elif inspect.isfunction(target) and hasattr(target, "__wrapped__"):
            target = target.__wrapped__
        else:
            break
    return target


def _inner(module: Any) -> Any:
    """The user's model inside torch's data-parallel wrappers (DistributedDataParallel and
    DataParallel keep it as `.module`): `DistributedDataParallel` names no model."""
    import torch

    for _ in range(8):
        inner = getattr(module, "module", None)
        wrapper_is_torch = (type(module).__module__ or "").startswith("torch.")
        if not wrapper_is_torch or not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return module


def _code_of(objects: list[Any]) -> str:
    """Digest of the source of `objects`, leaving out torch's own (versioned in env)."""
    sources = {}
    for obj in objects:
        module = getattr(obj, "__module__", "") or ""
        if module == "builtins" or module == "torch" or module.startswith("torch."):
            continue
        sources[_qualname(obj)] = _source(obj)
    return "src:" + hashlib.sha256(canonical_json(sources)).hexdigest()[:20]


@functools.lru_cache(maxsize=4096)
def _source(obj: Any) -> str:
    try:
        fast = class_source(obj) if inspect.isclass(obj) else None
        return fast if fast is not None else inspect.getsource(obj)
    except (OSError, TypeError, SyntaxError, ValueError):
        return ""


def _short(obj: Any) -> str:
    """A readable model name: the qualified name, from the innermost function scope on
    (`main.<locals>.Net` is `Net`; `Outer.Inner` stays)."""
    name = str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "model"))
    return name.rsplit("<locals>.", 1)[-1]


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(_jsonable(value))).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return _qualname(value) if callable(value) else repr(value)


def _scalar(value: Any) -> Scalar:
    return value if isinstance(value, (str, int, float, bool)) or value is None else repr(value)
