"""The servers under test: ours, nginx and redis, each a process tree on a loopback port.

Every one is a context manager yielding a `Service`, which finds the server's processes
(uvicorn and nginx fork workers) so each measurement can charge the server's CPU time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.benchlib import LOOPBACK, log, poll_until, wait_port
from benchmarks.harness.servers import LocalRedis, LocalServer, free_port

WORKERS = 2  # uvicorn workers: docker/Dockerfile's MEGACACHE_WORKERS; nginx gets as many


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process, 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Service:
    """A server under test: its name, port and process tree (for CPU accounting)."""

    name: str
    port: int
    pid: int
    pids: list[int] = field(default_factory=list)

    def refresh(self) -> Service:
        """Find the current process tree (uvicorn and nginx fork their workers)."""
        tree, found, todo = _children(), [], [self.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += tree.get(pid, [])
        self.pids = found
        return self

    def cpu_seconds(self) -> float:
        """CPU time the whole tree has used so far: take differences around a measurement."""
        return sum(_cpu_seconds(pid) for pid in self.pids)

    def worker_pids(self) -> list[int]:
        return [p for p in self.pids if p != self.pid]


NGINX_CONF = """\
worker_processes {workers};
{user}pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
    default_type application/octet-stream;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen {host}:{port};
        location /cas/ {{ root {data_dir}; }}
        location /static/ {{ root {prefix}; }}
        location /put/ {{
            root {prefix};
            dav_methods PUT;
            create_full_put_path on;
            client_max_body_size 0;
        }}
    }}
}}
"""


@contextlib.contextmanager
def nginx_service(prefix: Path, data_dir: Path) -> Iterator[Service]:
    """nginx serving `data_dir`/cas/ (our blob files, as stored) on a free loopback port.

    /static/ holds small reference files (the manifest), /put/ takes DAV PUTs. Run as the
    current user; as root, workers stay root so they can read our 0700 temp dirs.
    """
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    for sub in ("static", "put", "client_body"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(
        workers=WORKERS, user="user root;\n" if os.geteuid() == 0 else "", prefix=prefix,
        host=LOOPBACK, port=port, data_dir=data_dir))
    proc = subprocess.Popen([exe, "-c", str(conf), "-p", str(prefix), "-e",
                             str(prefix / "error.log"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc, "nginx")
        time.sleep(0.2)  # workers fork right after the master binds
        yield Service("nginx", port, proc.pid).refresh()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def ours_service(data_dir: Path) -> Iterator[tuple[Service, LocalServer]]:
    """Our server as users run it: a child `python -m megacache_server` process."""
    server = LocalServer(data_dir, "--workers", str(WORKERS), log_level="warning").start()
    try:
        assert server.proc is not None
        service = Service("ours", server.port, server.proc.pid)
        # /healthz answers once one worker is up: wait (30 s at most) for all of them
        poll_until(lambda: len(service.refresh().worker_pids()) >= WORKERS, 30, 0.1)
        time.sleep(1.0)  # the workers import the app after they fork
        yield service, server
    finally:
        server.stop()


@contextlib.contextmanager
def redis_service(workdir: Path) -> Iterator[Service | None]:
    """A throwaway redis-server, or None (with a note) when it is not installed."""
    try:
        redis = LocalRedis(workdir).start()
    except FileNotFoundError as exc:
        log(f"no Redis reference: {exc}")
        yield None
        return
    try:
        assert redis.proc is not None
        yield Service("redis", redis.port, redis.proc.pid).refresh()
    finally:
        redis.stop()


@contextlib.contextmanager
def py_spy(service: Service, out_dir: Path) -> Iterator[None]:
    """Record a py-spy flame graph of each uvicorn worker for the whole run (--profile-ours).

    Sampling costs the server a little; use it to find where time goes, not for the table.
    """
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "200", "--idle",
                               "--nonblocking", "-o", str(out_dir / f"ours-{pid}.svg")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for pid in service.worker_pids()]
    log(f"py-spy recording workers {service.worker_pids()} into {out_dir}")
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(timeout=60)
