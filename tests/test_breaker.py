"""The circuit breaker (megacache_client/transport/breaker.py): opening, half-opening, shared by the
processes of a node, and stopping the hammering of a misbehaving server."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port

from megacache_client.config import ClientConfig
from megacache_client.transport.breaker import CircuitBreaker, breaker_for
from megacache_client.transport.client import (
    CircuitOpenError,
    RemoteCache,
    TransportError,
)


def test_circuit_breaker_opens_and_half_opens():
    b = CircuitBreaker(threshold=2, reset_s=0.2)
    b.check()
    b.failure()
    b.check()
    b.failure()
    with pytest.raises(CircuitOpenError):
        b.check()
    time.sleep(0.25)
    b.check()  # half-open: one attempt allowed
    b.failure()  # and it failed again: open at once
    with pytest.raises(CircuitOpenError):
        b.check()
    time.sleep(0.25)
    b.check()
    b.success()
    b.check()
    assert not b.is_open


def test_a_refused_connection_opens_the_breaker_at_once(tmp_path: Path):
    """Nothing listens: the first request fails without a retry's backoff and opens the
    breaker for the node; the next fails at once without touching the network."""
    cfg = ClientConfig(url=f"http://127.0.0.1:{free_port()}", retries=2, connect_timeout_s=0.5)
    breaker = CircuitBreaker(threshold=3, reset_s=60)
    with RemoteCache(cfg, breaker) as remote:
        t = time.monotonic()
        with pytest.raises(TransportError) as refused:
            remote.get_entry("0" * 64)
        assert not isinstance(refused.value, CircuitOpenError)
        assert time.monotonic() - t < 0.15  # no backoff (0.2 s at least before a retry)
        assert breaker.is_open
        t = time.monotonic()
        with pytest.raises(CircuitOpenError):
            remote.get_entry("0" * 64)
        assert time.monotonic() - t < 0.05


@pytest.mark.e2e
def test_a_trainer_whose_server_is_down_builds_nothing_to_publish(tmp_path: Path,
                                                                  toolchain: Path):
    """The exit's publish round asks before it builds: with nothing listening at the URL it
    snapshots nothing, packs nothing and starts no precompile check (each of which only
    the server could use), and says why; the trainer ends as it would without a URL."""
    from conftest import need

    from benchmarks.harness.machines import Machine, run_job

    need("torch", "the trainer compiles a real model")
    with socket.socket() as held:  # bound, never listening: it refuses, and no server of
        held.bind(("127.0.0.1", 0))  # another worker can take the port (a free_port() did)
        run = run_job(Machine(tmp_path / "node", toolchain), "--model", "mlp", "--steps", "3",
                      "--megacache", "env",
                      env={"MEGACACHE_URL": f"http://127.0.0.1:{held.getsockname()[1]}",
                           "MEGACACHE_MODEL": "down", "OMP_NUM_THREADS": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.mc["outcome"] == "error", run.mc
    assert run.mc["publish_reason"].startswith("cache server unreachable: nothing built"), \
        run.mc
    assert len(run.warnings()) == 1, run.warnings()


def test_the_breaker_is_shared_by_the_processes_of_a_node(tmp_path: Path):
    url = "http://127.0.0.1:9"
    first = CircuitBreaker(threshold=2, reset_s=60, state_file=tmp_path / "b.json")
    other_rank = CircuitBreaker(threshold=2, reset_s=60, state_file=tmp_path / "b.json")
    first.failure()
    other_rank.check()  # one failure: still closed
    first.failure()
    with pytest.raises(CircuitOpenError):
        other_rank.check()
    other_rank.success()  # a rank that got through closes it for everyone
    first.check()
    (tmp_path / "b.json").write_text("garbage")  # unreadable state never raises
    first.check()

    # Another process of the node finds the same breaker by the server's URL and node dir.
    import subprocess
    import sys

    def other_process(then: str) -> str:
        code = ("import sys; from pathlib import Path; "
                "from megacache_client.transport.breaker import breaker_for; "
                "b = breaker_for(sys.argv[1], Path(sys.argv[2])); " + then)
        return subprocess.run([sys.executable, "-c", code, url, str(tmp_path)], check=True,
                              capture_output=True, text=True, timeout=60).stdout.strip()

    here = breaker_for(url, tmp_path)
    assert here.state_file is not None and here.state_file.parent == tmp_path / "breaker"
    here.check()
    assert other_process("[b.failure() for _ in range(b.threshold)]; print(b.state_file)") \
        == str(here.state_file)
    with pytest.raises(CircuitOpenError):  # opened there, open here
        here.check()
    here.success()
    assert other_process("print(b.is_open)") == "False"  # closed here, closed there


class BadServer:
    """A loopback HTTP server that misbehaves on purpose; counts connections."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            if self.mode == "500":
                body = b'{"error": {"message": "boom"}}'
                conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\nConnection: close"
                             b"\r\n\r\n%s" % (len(body), body))
            elif self.mode == "reset":  # promise 1 MB, send 100 KB, hang up
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n"
                             + b"x" * 100_000)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["500", "reset"])
def test_client_gives_up_quickly_and_the_breaker_stops_the_hammering(mode: str, tmp_path):
    bad = BadServer(mode)
    try:
        cfg = ClientConfig(url=bad.url, retries=2, read_timeout_s=2)
        breaker = CircuitBreaker(threshold=3, reset_s=60)
        started = time.monotonic()
        with RemoteCache(cfg, breaker) as remote:
            call = (lambda: remote.get_entry("0" * 64)) if mode == "500" else \
                (lambda: remote.download_blob("0" * 64, 1_000_000, tmp_path / "blob"))
            with pytest.raises(TransportError):
                call()
            seen = bad.connections
            for _ in range(10):
                with pytest.raises(CircuitOpenError):
                    call()
        assert bad.connections == seen == 3  # the first call's tries, then nothing
        assert time.monotonic() - started < 20
        assert not (tmp_path / "blob").exists()
    finally:
        bad.close()


@pytest.mark.e2e
def test_a_server_that_comes_back_gets_the_compile_of_a_trainer_that_started_without_it(
        tmp_path: Path, toolchain: Path):
    """The server is down when the trainer loads (one warning, a cold compile) and up
    before it ends: the exit's round finds it answering and publishes the cold compile."""
    import json
    import subprocess
    import sys

    from conftest import need
    from helpers import ServerProcess

    from benchmarks.harness.machines import TRAIN_JOB, Machine, clean_env

    need("torch", "the trainer compiles a real model")
    server = ServerProcess(tmp_path / "data")
    env = clean_env() | Machine(tmp_path / "node", toolchain).env() | {
        "MEGACACHE_URL": server.url, "MEGACACHE_MODEL": "comes-back", "OMP_NUM_THREADS": "1",
        "MEGACACHE_BREAKER_RESET_S": "1", "MEGACACHE_PRECOMPILE": "0"}
    trainer = subprocess.Popen([sys.executable, str(TRAIN_JOB), "--model", "mlp", "--steps",
                                "3", "--megacache", "env", "--init-s", "3"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stderr is not None
        for line in trainer.stderr:  # the load failed: now the server may come up
            if line.startswith("megacache: error"):
                break
        server.start()
        out, err = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, err[-3000:]
        result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
        assert result["megacache"]["outcome"] == "error", result["megacache"]
        assert result["megacache"]["published"], result["megacache"]["publish_reason"]
    finally:
        trainer.kill()
        server.stop()
