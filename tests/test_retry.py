"""Client rules without torch.compile: settings, model identity, the retry loop and breaker."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import need

from megacache_client.breaker import CircuitBreaker, breaker_for
from megacache_client.config import ClientConfig, ConfigError
from megacache_client.retry import Deadline, retry_after_s
from megacache_client.transport import (
    CircuitOpenError,
    DeadlineExceeded,
    RemoteCache,
    TransportError,
)


@pytest.mark.parametrize("name, raw, message", [
    ("FALLBACK", "flase", "MEGACACHE_FALLBACK='flase' is not a boolean"),
    ("SHIP_KERNELS", "maybe", "MEGACACHE_SHIP_KERNELS='maybe' is not a boolean"),
    ("MAX_RAW_BYTES", "16 gigs", "MEGACACHE_MAX_RAW_BYTES='16 gigs' is not a size"),
    ("MAX_RAW_BYTES", "0", "MEGACACHE_MAX_RAW_BYTES must be positive"),
    ("RETRIES", "2.5", "MEGACACHE_RETRIES='2.5' is not a whole number"),
    ("RETRIES", "-1", "MEGACACHE_RETRIES must be 0 or more"),
    ("LOAD_DEADLINE_S", "soon", "MEGACACHE_LOAD_DEADLINE_S='soon' is not a number"),
    ("LOAD_DEADLINE_S", "0", "LOAD_DEADLINE_S must be positive"),
])
def test_bad_settings_are_refused_with_the_variable_named(name: str, raw: str, message: str):
    with pytest.raises(ConfigError) as err:
        ClientConfig.from_env({"MEGACACHE_URL": "http://127.0.0.1:1", f"MEGACACHE_{name}": raw})
    assert message in str(err.value)


def test_settings_accept_units_and_boolean_words():
    env = {"MEGACACHE_MAX_RAW_BYTES": "16GiB", "MEGACACHE_FALLBACK": " No ",
           "MEGACACHE_SHIP_KERNELS": "ON", "MEGACACHE_LOAD_DEADLINE_S": "2.5"}
    cfg = ClientConfig.from_env(env)
    assert cfg.max_raw_bytes == 16 * 1024**3
    assert (cfg.fallback, cfg.ship_kernels, cfg.load_deadline_s) == (False, True, 2.5)
    assert ClientConfig.from_env({"MEGACACHE_MAX_RAW_BYTES": "512MB"}).max_raw_bytes == 512e6
    assert ClientConfig.from_env({"MEGACACHE_MAX_RAW_BYTES": "1000"}).max_raw_bytes == 1000
    assert ClientConfig.from_env({}, max_raw_bytes="1KiB").max_raw_bytes == 1024


def test_autoload_with_a_bad_setting_warns_and_the_process_runs(tmp_path: Path):
    """Zero-code mode cannot raise into the trainer: the error is one clear warning."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    env.update({"MEGACACHE_URL": "http://127.0.0.1:1", "MEGACACHE_FALLBACK": "flase"})
    code = ("import logging, sys; logging.basicConfig(format='%(message)s'); "
            "import megacache_autoload; megacache_autoload._enable(); print('ran')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ran"
    assert "MEGACACHE_FALLBACK='flase' is not a boolean" in out.stderr


# -- model identity ---------------------------------------------------------------------

def test_identity_sees_through_bound_methods_partials_and_decorators():
    torch = need("torch")
    from megacache_client.fingerprint import identity

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    class Decoder(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Trainer:
        def step(self, x):
            return x + 1

    def loss(a, b):
        return (a - b).abs().mean()

    @functools.wraps(loss)
    def logged(*args):
        return loss(*args)

    enc, dec = Encoder(), Decoder()
    assert identity(enc._call_impl) == identity(enc)  # what nn.Module.compile() passes
    assert identity(enc._call_impl).name == "Encoder"
    assert identity(dec._call_impl).name == "Decoder"
    assert identity(enc).code != identity(dec).code
    assert identity(enc.forward).name == "Encoder.forward"
    assert identity(enc.forward).code == identity(enc).code
    assert identity(torch.compile(enc)) == identity(enc)
    assert identity(torch.nn.DataParallel(enc)).name == "Encoder"  # a torch wrapper
    assert identity(torch.nn.DataParallel(enc)._call_impl).name == "Encoder"
    assert identity(Trainer().step).name == "Trainer.step"
    assert identity(loss).name.endswith("loss")
    assert identity(functools.partial(loss, b=1)) == identity(loss)
    assert identity(logged) == identity(loss)
    assert identity(loss).code != identity(Trainer().step).code


def test_fingerprint_config_takes_compile_options_and_ignores_defaults():
    need("torch")
    from megacache_client.fingerprint import compute, describe, differing

    plain = compute(model="m", code="c")
    spelled_out = compute(model="m", code="c", options={"fullgraph": False, "dynamic": None,
                                                        "mode": None, "disable": False})
    assert plain.key() == spelled_out.key()
    full = compute(model="m", code="c", options={"fullgraph": True})
    tuned = compute(model="m", code="c", options={"options": {"max_autotune": True}})
    assert len({plain.key(), full.key(), tuned.key()}) == 3
    assert differing(plain, full) == ["config"]
    assert "fullgraph: False vs True" in describe(plain, full)


# -- the retry loop, Retry-After, the deadline, the node's breaker ------------------------

class Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next scripted (status, headers, body); logs the time."""

    script: list[tuple[int, dict[str, str], bytes]] = []
    seen: list[tuple[float, str]] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).seen.append((time.monotonic(), self.path))
        status, headers, body = type(self).script.pop(0)
        self.send_response(status)
        for k, v in {"content-length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[type[Scripted]]:
    handler = type("Handler", (Scripted,), {"script": [], "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()
    server.server_close()


def test_retry_after_is_honoured(scripted):
    scripted.script = [(503, {"retry-after": "1"}, b"busy"), (404, {}, b"")]
    with RemoteCache(ClientConfig(url=scripted.url), CircuitBreaker()) as remote:
        assert remote.get_entry("0" * 64) is None
    (t1, _), (t2, _) = scripted.seen
    assert t2 - t1 >= 0.95  # waited what the server asked, not the 0.1-0.3 s backoff


def test_retry_after_longer_than_the_deadline_gives_up_and_opens_the_breaker(scripted):
    scripted.script = [(503, {"retry-after": "120"}, b"busy")]
    breaker = CircuitBreaker()
    with RemoteCache(ClientConfig(url=scripted.url), breaker, Deadline(2)) as remote:
        with pytest.raises(DeadlineExceeded):
            remote.get_entry("0" * 64)
        with pytest.raises(CircuitOpenError):  # the server said: not for two minutes
            remote.get_entry("0" * 64)
    assert len(scripted.seen) == 1


def test_a_5xx_on_a_blob_download_is_retried(scripted, tmp_path: Path):
    data = os.urandom(10_000)
    digest = hashlib.sha256(data).hexdigest()
    scripted.script = [(502, {}, b"bad gateway"), (200, {}, data)]
    breaker = CircuitBreaker(threshold=3)
    with RemoteCache(ClientConfig(url=scripted.url), breaker) as remote:
        remote.download_blob(digest, len(data), tmp_path / "blob")
    assert (tmp_path / "blob").read_bytes() == data
    assert [p for _, p in scripted.seen] == [f"/v1/cas/{digest}"] * 2
    assert not breaker.is_open


def test_retry_after_as_http_date():
    assert retry_after_s("7") == 7.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert retry_after_s("not a date") is None


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
                "from megacache_client.breaker import breaker_for; "
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


def test_hung_server_is_bounded_by_the_deadline_not_the_read_timeout():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    try:
        cfg = ClientConfig(url=f"http://127.0.0.1:{listener.getsockname()[1]}", retries=2,
                           read_timeout_s=30)
        breaker = CircuitBreaker()
        with RemoteCache(cfg, breaker, Deadline(1.0)) as remote, \
                pytest.raises(TransportError, match="1s load deadline"):
            remote.get_entry("0" * 64)
        assert breaker.is_open  # the node's other ranks will not wait on it too
    finally:
        listener.close()


# -- the CLI's options --------------------------------------------------------------------

def test_cli_global_options_go_before_or_after_the_subcommand():
    from megacache_client.cli import build_parser

    parser = build_parser()
    after = parser.parse_args(["ls", "--url", "http://a:1", "--token", "t", "--json"])
    before = parser.parse_args(["--url", "http://a:1", "--token", "t", "ls", "--json"])
    assert (after.url, after.token) == (before.url, before.token) == ("http://a:1", "t")
    # one given before is not undone by its absence after
    assert parser.parse_args(["--url", "http://b:2", "stats"]).url == "http://b:2"
    assert parser.parse_args(["stats"]).url is None


def test_cli_ls_with_url_after_the_subcommand_talks_to_that_server():
    import subprocess
    import sys

    from helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    out = subprocess.run([sys.executable, "-m", "megacache_client.cli", "ls", "--url", url],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 4  # unreachable (exit codes: docs/configuration.md)
    assert "list entries" in out.stderr and "unrecognized" not in out.stderr, out.stderr


@pytest.mark.parametrize("command, options", [
    ("fingerprint", ("--model", "--code")), ("ls", ("--model", "--json", "--url")),
    ("stats", ("--json", "--token")), ("push", ("--model", "--code")),
])
def test_cli_options_have_help(command: str, options: tuple[str, ...]):
    from megacache_client.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore
    helps = {opt: action.help for action in sub._actions for opt in action.option_strings}
    for option in options:
        assert helps[option], f"megacache {command} {option} has no help text"
