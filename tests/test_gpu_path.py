"""The GPU code paths that need no GPU: the fingerprint's GPU fields from a device
description, a bundle of another CUDA architecture as a clean miss (real server, real
lookup), and the GPU check script stopping at once on a machine without a GPU."""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import environment_missing, need
from helpers import ServerProcess

from megacache_client.config import ClientConfig
from megacache_client.lifecycle import Session
from megacache_client.steps.shipping import build_manifest, bundle_blob, upload_blobs
from megacache_client.torch import env as torch_env
from megacache_client.torch import megacache_io
from megacache_client.transport.breaker import CircuitBreaker
from megacache_client.transport.client import RemoteCache
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire.manifest import Fingerprint, Scalar

ROOT = Path(__file__).resolve().parent.parent
H100 = {"name": "NVIDIA H100 80GB HBM3", "major": 9, "minor": 0, "driver": 12040}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "major": 8, "minor": 0, "driver": 12040}
CPU_HW: dict[str, Scalar] = {"arch": "x86_64", "cpu_isa": "avx2",
                             "cxx": "g++ (Debian 12.2.0) 12.2.0"}
ENV: dict[str, Scalar] = {"torch": "2.13.0", "triton": "3.6.0", "python": "3.11",
                          "cuda": "12.8", "hip": None}


def gpu_fp(device: dict | None, code: str = "v1") -> Fingerprint:
    return Fingerprint(model="gpu-model", code=code, env=ENV,
                       hw={**CPU_HW, **torch_env.gpu_component(device)},
                       config={"backend": "inductor", "mode": "default"})


def test_the_fingerprint_names_the_gpu_its_architecture_and_driver() -> None:
    assert torch_env.gpu_component(H100) == {"gpu": "NVIDIA H100 80GB HBM3", "cc": "9.0",
                                             "cuda_driver": "12.4"}
    # a CPU machine: the fields it always had, no driver field (CPU keys do not change)
    assert torch_env.gpu_component(None) == {"gpu": None, "cc": None}
    rocm = {"name": "AMD Instinct MI300X", "major": 9, "minor": 4, "driver": None,
            "hip": "6.2", "gcn_arch": "gfx942:sramecc+:xnack-"}
    assert torch_env.gpu_component(rocm)["gcn_arch"] == "gfx942:sramecc+:xnack-"
    keys = {gpu_fp(d).key() for d in (H100, A100, {**H100, "driver": 12080}, None)}
    assert len(keys) == 4  # another architecture, another driver, no GPU: other keys
    assert gpu_fp({**H100, "name": "NVIDIA H100 80GB HBM3"}).key() == gpu_fp(H100).key()


def test_this_machine_describes_its_device_as_its_driver_does() -> None:
    """Held against what the machine says without torch: no GPU device node on a CPU
    machine; nvidia-smi's name and compute capability of GPU 0 on an NVIDIA one."""
    need("torch", "the device description is read from torch")
    described, hw = torch_env.device_description(), torch_env.hw_component()
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):  # no GPU
        assert described is None and (hw["gpu"], hw["cc"]) == (None, None), hw
        return
    smi = shutil.which("nvidia-smi")
    if smi is None:
        environment_missing("nvidia-smi", "a GPU machine's description is held against it")
    name, cap = subprocess.run(
        [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader", "--id=0"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip().split(", ")
    assert described is not None and described["name"] == name, (described, name)
    assert (hw["gpu"], hw["cc"]) == (name, cap), hw


@pytest.fixture(scope="module")
def local_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("gpu-srv") / "data").start()
    yield server
    server.stop()


def publish(server: ServerProcess, node_dir: Path, fp: Fingerprint) -> str:
    """An entry for `fp` as a producer on that GPU would write it."""
    config = ClientConfig(url=server.url, node_cache_dir=node_dir)
    node = NodeCache(node_dir)
    blob = bundle_blob(node, megacache_io.to_bytes({}))  # a Mega-Cache torch reads
    manifest = build_manifest(fp, [blob], {"inductor": 3, "autotune": 2}, 40.0)
    with RemoteCache(config, CircuitBreaker()) as remote:
        upload_blobs(remote, node, [blob])
        remote.put_entry(manifest)
    return manifest.key


def test_a_bundle_of_another_architecture_is_a_clean_miss(local_server: ServerProcess,
                                                          tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """An A100's entry on an H100: no exact hit, no fallback (other hw), no download, no
    error: a miss whose reason names the architecture."""
    need("torch", "the device description is read from torch")
    publish(local_server, tmp_path / "producer", gpu_fp(A100))
    config = ClientConfig(url=local_server.url, node_cache_dir=tmp_path / "consumer",
                          prefetch=False)
    session = Session(config, fingerprint=gpu_fp(H100, code="v2"))
    result = session.load()
    assert result.outcome == "miss", (result.outcome, result.reason)
    assert "hw (cc: '8.0' vs '9.0'" in result.reason and result.entry is None, result.reason
    assert result.bytes_down == 0 and not (tmp_path / "consumer" / "blobs").exists()
    # the same architecture with other code is the fallback: the lookup itself works
    same_arch = Session(dataclasses.replace(config, node_cache_dir=tmp_path / "c2"),
                        fingerprint=gpu_fp(A100, code="v2"))
    fallback = same_arch.load()
    assert fallback.outcome == "fallback" and fallback.differing == ["code"], fallback.reason


def test_gpu_check_stops_at_once_without_a_gpu(tmp_path: Path) -> None:
    """No nvidia-smi, or one that lists no GPU: a clear message and exit 69 before anything
    is installed. The second is shown by an nvidia-smi of our own first on PATH (as the
    driver's tool answers on a machine without a GPU), so the test runs on any machine."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    paths = [f"{fake}{os.pathsep}{os.environ['PATH']}"]
    if shutil.which("nvidia-smi") is None:
        paths.append(os.environ["PATH"])  # and without any nvidia-smi at all
    for path in paths:
        work = tmp_path / "work"
        started = time.monotonic()
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
                              env={"PATH": path, "HOME": str(tmp_path),
                                   "GPU_CHECK_DIR": str(work)},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 69, (proc.returncode, proc.stdout, proc.stderr)
        assert "gpu_check: no CUDA GPU on this machine" in proc.stderr, proc.stderr
        assert time.monotonic() - started < 10 and not work.exists()
