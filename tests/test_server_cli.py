"""`megacache-server` as an operator meets it: --help, settings errors, exit codes, logs,
/docs without a network, /metrics by Prometheus rules, and a supervisor killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import LOOPBACK, ServerProcess, free_port
from prometheus_client.parser import text_string_to_metric_families

from megacache_client.wire.exitcodes import ExitCode
from megacache_server.settings import Settings


def server_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    return subprocess.run([sys.executable, "-m", "megacache_server", *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, timeout=timeout, cwd=cwd)


def test_help_is_short_and_relevant_per_command():
    create = server_cli("token", "create", "--help")
    assert create.returncode == 0
    assert len(create.stdout.splitlines()) < 20, create.stdout
    assert "--name" in create.stdout and "--port" not in create.stdout
    gc = server_cli("gc", "--help").stdout
    assert "--dry-run" in gc and "--store-budget" in gc and "--workers" not in gc
    top = " ".join(server_cli("--help").stdout.split())  # as one line: wrapping varies
    assert "{critical,error,warning,info,debug}" in top and "{fs,s3}" in top
    assert "--auth, --no-auth" in top and "--s3-redirect, --no-s3-redirect" in top
    assert "default 8GiB" in top and "default 256MiB" in top
    assert "8589934592" not in top and "None" not in top
    assert "exit codes:" in top
    version = server_cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"megacache-server \d+\.\d+\.\d+\S*\n",
                                                    version.stdout)


def test_choices_ignore_case(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MEGACACHE_LOG_LEVEL", "INFO")
    monkeypatch.setenv("MEGACACHE_BLOB_STORE", "FS")
    settings = Settings()
    assert (settings.log_level, settings.blob_store) == ("info", "fs")
    assert server_cli("--log-level", "DEBUG", "--version").returncode == 0


def test_misspelt_variable_is_named_with_a_suggestion(tmp_path: Path):
    out = server_cli("token", "list", "--data-dir", str(tmp_path),
                     env={"MEGACACHE_STORE_BUGDET": "1GiB", "MEGACACHE_URL": "http://x"})
    assert out.returncode == ExitCode.OK, out.stderr
    assert "MEGACACHE_STORE_BUGDET" in out.stderr and "MEGACACHE_STORE_BUDGET?" in out.stderr
    assert "MEGACACHE_URL" not in out.stderr  # a client setting: known, not misspelt


def test_documented_exit_codes(tmp_path: Path):
    data = str(tmp_path / "data")
    assert server_cli("--no-such-flag").returncode == ExitCode.USAGE
    assert server_cli("--log-level", "loud").returncode == ExitCode.USAGE
    bad = server_cli("--data-dir", data, env={"MEGACACHE_LOG_LEVEL": "loud"})
    assert bad.returncode == ExitCode.CONFIG
    assert "MEGACACHE_LOG_LEVEL" in bad.stderr and "Traceback" not in bad.stderr
    assert server_cli("--host", "0.0.0.0", "--data-dir", data).returncode == ExitCode.CONFIG
    dead_redis = f"redis://{LOOPBACK}:{free_port()}/0"
    for workers in ("1", "2"):
        down = server_cli("--workers", workers, "--index", dead_redis, "--data-dir", data,
                          "--port", str(free_port()))
        assert down.returncode == ExitCode.UNAVAILABLE, (workers, down.stderr)
        assert "storage unavailable" in down.stderr
    assert not Path(data).exists()  # a server that did not start created no store
    here = tmp_path / "cwd"  # the default data dir is relative: nothing may appear here
    here.mkdir()
    listed = server_cli("token", "list", "--index", dead_redis, cwd=here)
    assert listed.returncode == ExitCode.UNAVAILABLE, listed.stderr
    checked = server_cli("fsck", "--index", dead_redis, "--data-dir", "a/b", cwd=here)
    assert checked.returncode == ExitCode.UNAVAILABLE, checked.stderr
    assert sorted(here.rglob("*")) == []
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for workers in ("1", "2"):
            out = server_cli("--workers", workers, "--port", port, "--data-dir", data)
            assert out.returncode == ExitCode.STARTUP, (workers, out.stderr)


def test_a_refused_command_creates_nothing_and_tokens_need_no_blob_store(tmp_path: Path):
    """A command the store refuses leaves no data dir or index file where it ran (one
    against a store that is down: test_documented_exit_codes); a token command opens the
    index alone, so it never makes blob folders."""
    here = tmp_path / "cwd"
    here.mkdir()
    refused = server_cli("token", "revoke", "no-such-token", cwd=here)  # the sqlite default
    assert refused.returncode == ExitCode.PROBLEM and "no token" in refused.stderr
    assert sorted(here.rglob("*")) == []
    kept = here / "kept"  # what was there before stays, even when the command fails
    kept.mkdir()
    server_cli("token", "revoke", "no-such-token", "--data-dir", str(kept), cwd=here)
    assert kept.is_dir() and list(kept.iterdir()) == []
    listed = server_cli("token", "list", "--data-dir", str(kept), cwd=here)
    assert listed.returncode == ExitCode.OK, listed.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["index.sqlite3"]  # no blob folders


def _port_free(port: int) -> bool:
    """Nobody listens on `port`: only a refused connection says so. A timeout (a listener
    too busy to accept) or any other error is not known free: this fails closed."""
    try:
        socket.create_connection((LOOPBACK, port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def test_port_free_is_only_a_refused_connection():
    """A listener that never accepts, its backlog full: a connection to it times out."""
    with socket.create_server((LOOPBACK, 0), backlog=0) as busy:
        port = busy.getsockname()[1]
        queued: list[socket.socket] = []
        try:
            while True:  # the premise: fill the backlog until a connection times out
                assert len(queued) < 16, "connections to a full backlog never timed out"
                queued.append(socket.create_connection((LOOPBACK, port), timeout=0.5))
        except TimeoutError:
            pass
        try:
            assert not _port_free(port)  # a listener that does not accept is not gone
        finally:
            for conn in queued:
                conn.close()


def test_workers_exit_when_their_supervisor_is_killed(tmp_path: Path):
    server = ServerProcess(tmp_path / "data", "--workers", "2").start()
    try:
        assert server.proc is not None
        assert httpx.get(server.url + "/healthz").status_code == 200
        os.kill(server.proc.pid, signal.SIGKILL)  # the supervisor only, not its group
        server.proc.wait()
        deadline = time.monotonic() + 5
        while not _port_free(server.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _port_free(server.port), "workers still answer after their supervisor died"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(server.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("processes of the killed server are still alive")
    finally:
        server.stop()


def test_own_metrics_dir_removed_and_a_users_dir_kept(tmp_path: Path):
    users = tmp_path / "prom"
    users.mkdir()
    (users / "keep.txt").write_text("theirs")
    server = ServerProcess(tmp_path / "a", "--workers", "2",
                           env={"PROMETHEUS_MULTIPROC_DIR": str(users)}).start()
    server.stop()
    assert (users / "keep.txt").read_text() == "theirs"
    strays = set(Path.cwd().glob("counter_*.db"))  # where an empty setting once wrote
    own = ServerProcess(tmp_path / "b", "--workers", "2",
                        env={"PROMETHEUS_MULTIPROC_DIR": ""}).start()
    own_dir = (tmp_path / "b").resolve() / ".metrics" / str(own.port)
    assert own_dir.is_dir()
    assert httpx.get(f"{own.url}/metrics", timeout=30).status_code == 200
    own.stop()
    assert not own_dir.exists()
    assert set(Path.cwd().glob("counter_*.db")) == strays


def test_log_level_governs_megacache_logs_in_both_formats(tmp_path: Path):
    text = ServerProcess(tmp_path / "t", log_level="INFO").start()
    text.stop()
    assert re.search(r"^INFO\s+megacache\.server: megacache-server ", text.log(), re.M)
    quiet = ServerProcess(tmp_path / "q", log_level="warning").start()
    quiet.stop()
    assert "megacache.server" not in quiet.log()
    js = ServerProcess(tmp_path / "j", "--log-format", "json", log_level="info").start()
    js.stop()
    lines = [json.loads(line) for line in js.log().splitlines() if line.strip()]
    assert lines[0]["logger"] == "megacache.server" and lines[0]["event"] == "start"


def test_docs_work_offline(tmp_path: Path):
    with ServerProcess(tmp_path / "data") as server:
        page = httpx.get(server.url + "/docs")
        assert page.status_code == 200 and "swagger-ui-bundle.js" in page.text
        assert "http://" not in page.text and "https://" not in page.text
        for asset in re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', page.text):
            assert httpx.get(server.url + asset).status_code == 200, asset


# promtool check metrics, the rules that apply to names and types
def test_metrics_follow_prometheus_naming_rules(tmp_path: Path):
    with ServerProcess(tmp_path / "data") as server:
        httpx.get(server.url + "/healthz")
        text = httpx.get(server.url + "/metrics").text
    families = list(text_string_to_metric_families(text))  # raises on a malformed exposition
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    mine = [f for f in families if f.name.startswith("megacache_")]
    assert mine
    for f in mine:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", f.name), f.name  # snake_case
        assert f.documentation, f"{f.name} has no HELP"
        if f.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in f.samples), f.name
        else:
            assert not f.name.endswith("_total"), f"{f.name}: _total on a {f.type}"
        for word in ("counter", "gauge", "histogram", "summary"):
            assert word not in f.name.split("_"), f"{f.name} names its type"


def test_s3_without_boto3_names_the_extra(tmp_path: Path):
    code = ("import sys; sys.modules['boto3'] = None; "  # as if the [s3] extra were absent
            "from megacache_server.cli import main; sys.exit(main(sys.argv[1:]))")
    for args in ([], ["gc"]):
        out = subprocess.run([sys.executable, "-c", code, *args, "--blob-store", "s3",
                              "--data-dir", str(tmp_path)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == ExitCode.CONFIG, out.stderr
        assert "megacache[server,s3]" in out.stderr and "Traceback" not in out.stderr


def test_cli_help_and_bad_settings():
    out = subprocess.run([sys.executable, "-m", "megacache_server", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--host", "--port", "--data-dir", "--max-blob-size", "--store-budget",
                 "--workers", "--log-level"):
        assert flag in out
    bad = subprocess.run([sys.executable, "-m", "megacache_server", "--port", "99999"],
                         capture_output=True, text=True)
    assert bad.returncode == 3  # ExitCode.CONFIG
    assert "MEGACACHE_PORT" in bad.stderr and "Traceback" not in bad.stderr
