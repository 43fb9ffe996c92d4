"""The torch range the client supports: declared once, enforced at enable().

A torch outside the range (a real older torch's version, given by a small `torch` package
first on sys.path: the client reads what `import torch` gives it) leaves the client inert:
one warning naming the torch found and the range, no traceback, no connection to the
server (a listening loopback socket that must see none), torch.compile untouched.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import need

from megacache_client.torch import supported

ROOT = Path(__file__).resolve().parent.parent

FAKE_TORCH = '''\
"""A stand-in for an installed torch: its version and only the APIs that version has."""
__version__ = {version!r}


class _Namespace:
    pass


compiler = _Namespace()
{extra}
backends = _Namespace()
backends.cpu = _Namespace()
backends.cpu.get_cpu_capability = lambda: "AVX2"
COMPILED = []


def compile(model=None, **kwargs):
    COMPILED.append(model)
    return model
'''

JOB = '''\
import json, sys
{prelude}
import torch
import megacache_client
from megacache_client.torch import hook

original = torch.compile
session = megacache_client.enable(model="mlp", code="v1")
compiled = torch.compile(lambda x: x + 1)
print(json.dumps({{
    "outcome": session.load_result.outcome, "reason": session.load_result.reason,
    "hook_installed": torch.compile is not original or hook.active_session() is not None,
    "runs": compiled(1), "closed_event": repr(session.close()),
}}))
'''

ZERO_CODE = "import megacache_autoload; megacache_autoload.activate_from_env()"


def fake_torch(root: Path, version: str, extra: str) -> Path:
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCH.format(version=version, extra=extra))
    return root


def run_job(tmp_path: Path, version: str, *, extra: str = "", prelude: str = "",
            mode: str = "read-write") -> tuple[dict, str, int]:
    """The job against a listening loopback server; returns its result, its stderr and
    how many connections the server saw."""
    path = fake_torch(tmp_path / "fake", version, extra)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.setblocking(False)
        env = {"PYTHONPATH": f"{path}:{ROOT}", "MEGACACHE_URL":
               f"http://127.0.0.1:{server.getsockname()[1]}", "MEGACACHE_MODE": mode,
               "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "node"), "PATH": "/usr/bin:/bin",
               "HOME": str(tmp_path)}
        proc = subprocess.run([sys.executable, "-c", JOB.format(prelude=prelude)], env=env,
                              capture_output=True, text=True, timeout=120)
        connections = 0
        while True:
            try:
                server.accept()[0].close()
                connections += 1
            except BlockingIOError:
                break
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, connections


def test_versions_in_and_out_of_the_range() -> None:
    for version in ("2.9.0", "2.9.1", "2.13.0", "2.13.0+cpu", "2.14.1", "2.14.1+cu128"):
        assert supported.in_range(version), version
    for version in ("2.5.1", "2.8.0", "2.15.0", "2.15.0.dev20261201", "3.0.0", "", "dev"):
        assert not supported.in_range(version), version
    lowest, below = (".".join(map(str, v)) for v in (supported.LOWEST, supported.BELOW))
    assert f">={lowest},<{below}" == supported.SUPPORTED_TORCH


def test_the_range_is_stated_alike_everywhere() -> None:
    """pyproject (where torch stays out of the dependencies), the README, the docs."""
    tomllib = need("tomllib", "Python >= 3.11 reads pyproject.toml")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["megacache"]["supported-torch"] == supported.SUPPORTED_TORCH
    deps = project["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"torch\b", d)], deps
    for doc in ("README.md", "docs/configuration.md"):
        assert f"torch{supported.SUPPORTED_TORCH}" in (ROOT / doc).read_text(), doc


@pytest.mark.parametrize("zero_code", [False, True], ids=["explicit", "zero-code+explicit"])
def test_a_torch_below_the_range_leaves_the_client_inert(tmp_path: Path,
                                                         zero_code: bool) -> None:
    result, stderr, connections = run_job(tmp_path, "2.5.1",
                                          prelude=ZERO_CODE if zero_code else "")
    assert result["outcome"] == "inert" and "2.5.1" in result["reason"], result
    assert not result["hook_installed"] and result["runs"] == 2, result
    assert result["closed_event"] == "None"  # nothing reported
    assert connections == 0, "the inert client connected to the server"
    warnings = [line for line in stderr.splitlines() if line.strip()]
    assert len(warnings) == 1, stderr  # one warning, no traceback
    assert "torch 2.5.1" in warnings[0] and f"torch{supported.SUPPORTED_TORCH}" in warnings[0]
    assert "inert" in warnings[0] and "Traceback" not in stderr


def test_required_mode_refuses_an_unsupported_torch(tmp_path: Path) -> None:
    path = fake_torch(tmp_path / "fake", "2.5.1", "")
    code = textwrap.dedent('''
        import megacache_client
        try:
            megacache_client.enable(url="http://127.0.0.1:9", mode="required")
        except megacache_client.MegacacheError as exc:
            print("refused:", exc)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": f"{path}:{ROOT}"},
                          capture_output=True, text=True, timeout=60)
    assert "refused: megacache inert: torch 2.5.1 is outside" in proc.stdout, proc.stderr


def test_a_torch_in_the_range_without_an_api_gets_a_clear_message(tmp_path: Path) -> None:
    """torch 2.5.1's actual gap (no torch.compiler.config), in a build claiming 2.13."""
    result, stderr, connections = run_job(tmp_path, "2.13.0", extra=(
        "compiler.save_cache_artifacts = compiler.load_cache_artifacts = lambda *a: None"))
    assert result["outcome"] == "inert", result
    assert "torch 2.13.0 lacks torch.compiler.config" in result["reason"], result
    assert connections == 0
    assert stderr.count("megacache:") == 1 and "Traceback" not in stderr, stderr
