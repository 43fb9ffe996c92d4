"""What the client probes of torch's environment, imported only once torch is in use.

Fingerprint facts (versions, ISA, GPU, compiler; `steps/fingerprint.py` combines them), where
torch keeps its caches, its compile metrics and hit counters, and PGO's job id. Reading and
writing the Mega-Cache bundle itself is `megacache_io.py`'s. Keeping torch behind these
modules means the rest of the client imports without torch and can be reasoned about alone.
"""

from __future__ import annotations

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


def set_job_id(job_id: str) -> str:
    """Give PGO a job id so automatic-dynamic profiles are recorded and travel in bundles."""
    config = torch_module().compiler.config
    if not config.job_id:
        config.job_id = job_id
    return str(config.job_id)
