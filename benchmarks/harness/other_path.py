"""A second Python environment whose torch lives at another path, for `megacache-other-path`.

Inductor's compiled-kernel names hash g++ flags that hold torch's install path, so a
consumer with torch in another venv (or /opt/conda vs /usr/local) is the case where shipped
kernels must be re-keyed. The venv is made once and kept between runs (`pip install
torch==2.13.0`, the same numpy as here, and this package's dependencies); jobs run this
checkout's megacache_client through PYTHONPATH, so the venv never goes stale.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

DEFAULT_VENV = Path("/tmp/mc-otherpath/venv")
REPO = Path(__file__).resolve().parents[2]
TORCH_PIN = "torch==2.13.0"
CLIENT_DEPS = ("httpx", "zstandard", "filelock", "pydantic")


class OtherPath:
    """The second venv: `python` to run jobs with, `env()` to add to their environment."""

    def __init__(self, venv: Path = DEFAULT_VENV) -> None:
        self.venv = venv
        self.python = venv / "bin" / "python"

    def ensure(self, log: Callable[[str], None] = print) -> OtherPath:
        """Create the venv unless it already imports torch and the client's dependencies."""
        if self.ready():
            return self
        log(f"creating the other-path venv at {self.venv} (kept for later runs)")
        if not self.python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
        pins = [TORCH_PIN, *CLIENT_DEPS]
        with contextlib.suppress(metadata.PackageNotFoundError):
            pins.append(f"numpy=={metadata.version('numpy')}")
        subprocess.run([str(self.python), "-m", "pip", "install", "-q", *pins], check=True)
        if not self.ready():
            raise RuntimeError(f"{self.venv} still cannot import torch after pip install")
        return self

    def ready(self) -> bool:
        if not self.python.exists():
            return False
        probe = "import torch, httpx, zstandard, filelock, pydantic"
        return subprocess.run([str(self.python), "-c", probe], capture_output=True,
                              check=False).returncode == 0

    def torch_dir(self) -> str:
        out = subprocess.run([str(self.python), "-c", "import torch, os; "
                              "print(os.path.dirname(torch.__file__))"],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip().splitlines()[-1]

    def env(self) -> dict[str, str]:
        """This checkout's client first on the path, ahead of any copy in the venv."""
        extra = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": str(REPO) + (os.pathsep + extra if extra else "")}
