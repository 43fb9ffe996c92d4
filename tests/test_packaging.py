"""What a user gets from `pip install`: sdist -> wheel -> a fresh venv, and the editable install.

The wheel is built from the sdist (not from the checkout), so a file the sdist forgets fails
here as it would for a user. The fresh venv gets the base install only (no extras): the
client works, the zero-code hook is in site-packages, and `megacache-server` says which
extra to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from conftest import environment_missing

from megacache_client import __version__
from megacache_client.wire.exitcodes import ExitCode

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SERVER_DISTS = ("fastapi", "starlette", "uvicorn", "redis", "pydantic-settings",
                "prometheus-client", "boto3", "botocore", "swagger-ui-bundle")
WATCHER = ("import sys; print(any(type(f).__name__ == 'TorchImportWatcher' "
           "for f in sys.meta_path))")


def run(*cmd: str | Path, env: dict[str, str] | None = None, timeout: float = 300,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                         timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel built from that sdist), with the backend of this environment."""
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out, ROOT)
    sdist = next(out.glob("megacache-*.tar.gz"))
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", out, sdist)
    return sdist, next(out.glob("megacache-*.whl"))


def test_sdist_carries_what_the_wheel_needs(dists: tuple[Path, Path]):
    sdist, _ = dists
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"megacache_autoload.pth", "megacache_autoload.py", "LICENSE", "pyproject.toml",
            "megacache_client/wire/version.py", "benchmarks/harness/servers.py"} <= names


def test_wheel_contents_and_metadata(dists: tuple[Path, Path]):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"megacache_autoload.pth", "megacache_autoload.py", "megacache_client/py.typed",
            "megacache_server/py.typed", "megacache_server/api/static/dashboard.html",
            "megacache_server/store/index/redis/scripts/listed.lua"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    # test and benchmark scaffolding stays out of the wheel
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))
                or n.endswith(("services.py", "local.py"))]
    assert f"Version: {__version__}" in meta
    assert "License-Expression: Apache-2.0" in meta
    assert "Classifier: Typing :: Typed" in meta and "Project-URL: Source" in meta
    base = [line for line in meta.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert base and not any(dep in line for line in base
                            for dep in ("fastapi", "uvicorn", "boto3", "torch"))
    s3 = [line for line in meta.splitlines() if "extra == 's3'" in line or
          'extra == "s3"' in line]
    assert any("botocore>=1.35.2" in line for line in s3), s3  # IfNoneMatch needs it


def test_fresh_venv_without_extras(dists: tuple[Path, Path], tmp_path: Path):
    """The base install from the wheel: client CLI, hook, server hint; then uninstall."""
    _, wheel = dists
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    py, bindir = venv / "bin" / "python", venv / "bin"
    run(py, "-m", "pip", "install", "-q", wheel)
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())
    assert (site / "megacache_autoload.pth").read_text() == \
        (ROOT / "megacache_autoload.pth").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGACACHE_", "PYTHON"))}
    assert "usage: megacache" in run(bindir / "megacache", "--help", env=env).stdout
    hint = run(bindir / "megacache-server", env=env, check=False)
    assert hint.returncode == ExitCode.CONFIG
    assert hint.stderr.count("\n") == 1 and "megacache[server]" in hint.stderr, hint.stderr
    assert "Traceback" not in hint.stderr
    installed = json.loads(run(py, "-m", "pip", "list", "--format", "json").stdout)
    names = {d["name"].lower().replace("_", "-") for d in installed}
    assert "megacache" in names and not names & set(SERVER_DISTS), names & set(SERVER_DISTS)
    # zero code: with MEGACACHE_URL set the hook waits for torch (not installed here)
    url_env = {**env, "MEGACACHE_URL": "http://127.0.0.1:9"}
    assert run(py, "-c", WATCHER, env=url_env).stdout.strip() == "True"
    run(py, "-m", "pip", "uninstall", "-q", "-y", "megacache")
    assert not (site / "megacache_autoload.pth").exists()
    assert not (site / "megacache_autoload.py").exists()
    after = run(py, "-c", "pass", env=url_env)
    assert after.stderr == ""


def test_editable_install_has_the_hook():
    """The README installs with `pip install -e`: zero code must work there too."""
    purelib = sysconfig.get_paths()["purelib"]  # not a stale megacache.egg-info in the cwd
    dist = next(iter(metadata.distributions(name="megacache", path=[purelib])), None)
    if dist is None:
        environment_missing("an installed megacache", f"not in {purelib}")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if not direct.get("dir_info", {}).get("editable"):
        environment_missing("an editable install of megacache", "installed without -e")
    pth = Path(str(dist.locate_file("megacache_autoload.pth")))
    assert pth.read_text() == (ROOT / "megacache_autoload.pth").read_text()
    env = {**os.environ, "MEGACACHE_URL": "http://127.0.0.1:9"}
    assert run(sys.executable, "-c", WATCHER, env=env).stdout.strip() == "True"


def test_pth_line_is_silent_when_the_package_is_gone(tmp_path: Path):
    """A .pth left behind (copied by hand, a broken uninstall) must not print at every start."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "megacache_autoload.pth").write_text((ROOT / "megacache_autoload.pth").read_text())
    env = {"PATH": os.environ.get("PATH", ""), "MEGACACHE_URL": "http://127.0.0.1:9"}
    # -S -I: no site-packages of ours, so `megacache_autoload` cannot be imported
    out = run(sys.executable, "-S", "-I", "-c",
              f"import site; site.addsitedir({str(site)!r}); print('ok')", env=env)
    assert out.stdout.strip() == "ok" and out.stderr == ""
