"""Everything the client asks of torch, in one place, imported only once torch is in use.

Fingerprint facts (versions, ISA, compiler; `steps/fingerprint.py` combines them), where torch
keeps its caches, its compile metrics and hit counters, and the Mega-Cache save/load calls.
Keeping torch behind this module means the rest of the client imports without torch and
can be reasoned about alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from megacache_client.wire.manifest import Scalar


def torch_module() -> Any:
    import torch

    return torch


def torch_version() -> str:
    return str(torch_module().__version__)


def triton_version() -> str | None:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def torch_prefix() -> str:
    """Where torch is installed (resolved): what packs of older clients were bound to."""
    return str(Path(torch_module().__file__).resolve().parent)


def env_component() -> dict[str, Scalar]:
    torch = torch_module()
    return {
        "torch": torch_version(),
        "triton": triton_version(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }


def hw_component() -> dict[str, Scalar]:
    """What the compiled code depends on about the machine — never which machine it is."""
    torch = torch_module()
    hw: dict[str, Scalar] = {
        "arch": platform.machine(),
        "cpu_isa": str(torch.backends.cpu.get_cpu_capability()).lower(),
        "cxx": cxx_version(),
    }
    return {**hw, **gpu_component(device_description())}


DeviceDescription = dict[str, Any]
"""What the fingerprint reads of GPU 0: name, major, minor (compute capability), driver
(the CUDA driver API version, e.g. 12040), hip and gcn_arch (ROCm)."""


def device_description() -> DeviceDescription | None:
    """GPU 0 as torch sees it, or None on a machine without one."""
    torch = torch_module()
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    driver = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        driver_version = int(driver()) if driver is not None else None
    except Exception:  # a ROCm build, an old torch
        driver_version = None
    hip = getattr(torch.version, "hip", None)
    return {"name": torch.cuda.get_device_name(0), "major": major, "minor": minor,
            "driver": driver_version, "hip": hip,
            "gcn_arch": getattr(torch.cuda.get_device_properties(0), "gcnArchName", None)
            if hip else None}


def gpu_component(device: DeviceDescription | None) -> dict[str, Scalar]:
    """The fingerprint's GPU fields. Triton's cubins (in the bundle's FX graph entries)
    and autotune results are built for one compute capability (`cc`); a bundle made on
    another is another key, so a consumer never loads it (a clean miss, no fallback: the
    fallback needs the same hw). `cuda_driver` is the CUDA version the driver supports
    (`12.4`, not the driver build): a cubin built by a newer ptxas may need a newer driver.
    A CPU machine keeps `gpu` and `cc` at None and has no driver field, as before."""
    if device is None:
        return {"gpu": None, "cc": None}
    hw: dict[str, Scalar] = {"gpu": str(device["name"]),
                             "cc": f"{device['major']}.{device['minor']}"}
    driver = device.get("driver")
    if device.get("hip"):
        hw["gcn_arch"] = device.get("gcn_arch")
    elif isinstance(driver, int) and driver > 0:
        hw["cuda_driver"] = f"{driver // 1000}.{driver % 1000 // 10}"
    return hw


def cxx_version() -> str | None:
    """First line of `<compiler> --version` for the compiler Inductor will use."""
    return _version_line(cpp_compiler())


@functools.cache
def _version_line(compiler: str) -> str | None:
    out = compiler_output("--version", compiler=compiler)
    first = out.strip().splitlines()[0] if out and out.strip() else None
    return first[:200] if first else None


def compiler_output(*args: str, compiler: str | None = None) -> str | None:
    """stdout of `compiler` (default: the one Inductor will use) run with `args`, or None
    if it cannot run."""
    try:
        run = subprocess.run([compiler or cpp_compiler(), *args], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout


def cpp_compiler() -> str:
    """The C++ compiler Inductor will use, found without importing Inductor if it can be.

    Importing anything under `torch._inductor` imports Dynamo (2 s, the bulk of the
    client's cost at enable). Until Inductor's config is imported nobody can have changed
    it, so its defaults decide: `$CXX`, else g++ (clang++ on macOS), the first that runs.
    The cases the defaults do not cover (Windows, conda's g++, fbcode) ask Inductor itself.
    """
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is None and sys.platform != "win32" \
            and not os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
        default = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
        return default if _runs(default) else shutil.which("g++") or "g++"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return str(get_cpp_compiler())
    except Exception:
        return shutil.which("g++") or "g++"


def _runs(compiler: str) -> bool:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=10,
                              check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def inductor_cache_dir() -> Path:
    return Path(_cache_dir_utils().cache_dir())


def header_dir() -> Path:
    """Where Inductor keeps precompiled headers (under TMPDIR, not the cache dir)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None:
        return Path(codecache._HEADER_DIR)
    # how codecache names it when it is imported
    return Path(_cache_dir_utils().default_cache_dir()) / "precompiled_headers"


@functools.cache
def _cache_dir_utils() -> ModuleType:
    """Inductor's cache-dir module, torch's own code, loaded alone when Inductor is not
    imported yet: importing it as `torch._inductor.…` would import Inductor and Dynamo
    with it, and the module is written to need neither."""
    loaded = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if loaded is not None:
        return loaded
    origin = Path(torch_module().__file__).parent / "_inductor" / "runtime" / \
        "cache_dir_utils.py"
    spec = importlib.util.spec_from_file_location("_megacache_inductor_cache_dir_utils",
                                                  origin)
    try:
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {origin}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:
        from torch._inductor.runtime import cache_dir_utils

        return cache_dir_utils


def compile_seconds() -> float:
    """Seconds torch spent compiling in this process, by its own metrics."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "fxgraph_hit": int(inductor["fxgraph_cache_hit"]),
        "fxgraph_miss": int(inductor["fxgraph_cache_miss"]),
        "aot_hit": int(aot["autograd_cache_hit"]),
        "aot_miss": int(aot["autograd_cache_miss"]),
    }


Artifacts = dict[str, list[Any]]
"""A Mega-Cache bundle read by torch: artifact type -> its artifacts (each has `.key`)."""


def read_artifacts(raw: bytes) -> Artifacts | None:
    """Mega-Cache bytes as torch's artifacts, or None if torch could not read them.

    The bytes of a process that saved more than once hold one chunk per type per save
    (torch appends); torch's own reader makes a dict of the chunks, so each type keeps
    only its last save's artifacts. Here the chunks of a type are joined (one artifact per
    key, the latest), so a second publish round ships the first round's graphs too."""
    from torch.compiler import _cache

    try:
        register = getattr(_cache.CacheArtifactManager, "_ensure_cache_artifacts_registered",
                           lambda: None)
        read_one = _cache._deserialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except (AttributeError, ImportError):  # another torch: its own reader, as it reads
        artifacts = _cache.CacheArtifactManager.deserialize(raw)
        return dict(artifacts) if artifacts is not None else None
    try:
        register()
        chunks = AppendingByteSerializer.to_list(raw, deserialize_fn=read_one)
    except Exception:
        return None
    out: dict[str, dict[str, Any]] = {}
    for kind, items in chunks:
        out.setdefault(kind, {}).update((a.key, a) for a in items)
    return {kind: list(by_key.values()) for kind, by_key in out.items()}


def populate(artifacts: Artifacts) -> dict[str, list[str]]:
    """Hot-load artifacts into torch's caches, as `torch.compiler.load_cache_artifacts`
    does after reading the bytes; returns the loaded keys per type."""
    from torch.compiler._cache import CacheArtifactManager

    info = CacheArtifactManager.populate_caches(artifacts)
    return {k: list(v) for k, v in info.artifacts.items()}


def without(artifacts: Artifacts, kind: str, keys: set[str] | None = None) -> Artifacts:
    """`artifacts` less those of type `kind` (only those of `keys` when given)."""
    return {k: [a for a in items if k != kind or (keys is not None and a.key not in keys)]
            for k, items in artifacts.items()}


def merged(base: Artifacts, new: Artifacts) -> Artifacts:
    """Both sets of artifacts, one per (type, key); `new`'s wins where both have one."""
    out = {kind: {a.key: a for a in items} for kind, items in base.items()}
    for kind, items in new.items():
        out.setdefault(kind, {}).update((a.key, a) for a in items)
    return {kind: list(by_key.values()) for kind, by_key in out.items() if by_key}


def keys_of(artifacts: Artifacts) -> dict[str, list[str]]:
    return {kind: [a.key for a in items] for kind, items in artifacts.items() if items}


def to_bytes(artifacts: Artifacts) -> bytes:
    """Artifacts as Mega-Cache bytes, in torch's own format (what `save_cache_artifacts`
    writes and `load_cache_artifacts` reads)."""
    from torch.compiler._cache import _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    writer: AppendingByteSerializer[Any] = AppendingByteSerializer(
        serialize_fn=_serialize_single_cache)
    writer.extend((k, v) for k, v in artifacts.items() if v)
    return bytes(writer.to_bytes())


def save_bundle(precompile: bool = False) -> tuple[bytes, dict[str, list[str]]] | None:
    """torch's Mega-Cache of this process so far (cumulative: torch keeps what it serialised
    before and appends), with its keys per type; None when torch recorded nothing.
    `precompile`: this process records precompiled Dynamo output (its packages are saved
    into the Mega-Cache first).

    Safe from a background thread while the trainer runs: Dynamo's compile lock guards
    torch's record of artifacts, and what a compile outside that lock (a lazily compiled
    backward) recorded while torch was serialising is queued again for the next save
    (`_requeue_unsaved`), never dropped. torch's settings are per thread (the trainer's
    `caching_precompile` is not this thread's), hence `precompile` is said, not read."""
    torch = torch_module()
    patch = torch._dynamo.config.patch(caching_precompile=True) if precompile \
        else contextlib.nullcontext()
    with compile_lock(), patch:
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return None
        raw, info = result
        keys = {k: list(v) for k, v in info.artifacts.items()}
        _requeue_unsaved(keys)
    return raw, keys


def compile_lock() -> Any:
    """Dynamo's compile lock (held while a frame compiles), or a no-op where torch has none."""
    try:
        from torch._dynamo.convert_frame import compile_lock as lock
    except Exception:
        return contextlib.nullcontext()
    return lock if hasattr(lock, "__enter__") else contextlib.nullcontext()


def artifacts_recorded() -> int:
    """How many cache artifacts torch has recorded in this process (compiled or served from
    a cache): it grows with every compile, so a count that stays put across a training step
    means the compiles have settled (`steps/settle.py`). Cheap, from any thread; -1 when
    torch cannot say."""
    try:
        from torch.compiler._cache import CacheArtifactManager

        return len(CacheArtifactManager._seen_artifacts)
    except Exception:
        return -1


def _requeue_unsaved(saved: dict[str, list[str]]) -> None:
    """Put back what torch recorded but did not serialise: `serialize` clears its list of
    new artifacts after writing, so one recorded in between (by a compile that does not
    hold the compile lock) would be left out of every later save."""
    try:
        from torch.compiler._cache import CacheArtifactManager as manager

        have = {(kind, k) for kind, ks in saved.items() for k in ks}
        for artifact in list(manager._seen_artifacts):
            kind = artifact.type()
            queued = manager._new_cache_artifacts.get(kind, [])
            if (kind, artifact.key) not in have and artifact not in queued:
                manager._new_cache_artifacts[kind].append(artifact)
    except Exception:  # torch's internals moved: the next save is as torch makes it
        return


def set_job_id(job_id: str) -> str:
    """Give PGO a job id so automatic-dynamic profiles are recorded and travel in bundles."""
    config = torch_module().compiler.config
    if not config.job_id:
        config.job_id = job_id
    return str(config.job_id)
