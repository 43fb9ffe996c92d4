"""Run a megacache-server in a child process on a free loopback port.

For the demo, the benchmarks and the tests: the server is started exactly as a user starts
it (`python -m megacache_server ...`), never in-process, so what they measure is what users
run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class LocalServer:
    """`megacache-server` on 127.0.0.1; start(), stop(), kill(), restart with start() again."""

    def __init__(self, data_dir: Path, *extra_args: str, env: dict[str, str] | None = None,
                 log_level: str = "warning") -> None:
        self.data_dir = Path(data_dir)
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.log_level = log_level
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 30.0) -> LocalServer:
        cmd = [sys.executable, "-m", "megacache_server", "--host", LOOPBACK,
               "--port", str(self.port), "--log-level", self.log_level, *self.extra_args]
        if "MEGACACHE_DATA_DIR" not in self.env:
            cmd += ["--data-dir", str(self.data_dir)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
