"""The `megacache` command and the packaging of the zero-code hook."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import ServerProcess, free_port, make_fingerprint, make_manifest, sha256

from megacache_client.wire.exitcodes import ExitCode
from megacache_client.wire.manifest import Fingerprint

ROOT = Path(__file__).resolve().parent.parent


def megacache(*args: str, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "megacache_client.cli", *args],
                          capture_output=True, text=True, env=full_env, cwd=cwd, timeout=120)


@pytest.mark.e2e  # real torch and the toolchain probe, in three processes
def test_fingerprint_is_the_same_on_any_host_and_names_no_host(tmp_path: Path):
    need("torch")
    outputs = []
    for i in range(2):
        host_env = {"HOSTNAME": f"node-{i}", "TMPDIR": str(tmp_path / f"tmp{i}"),
                    "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"ind{i}"), "RANK": str(i),
                    "LOCAL_RANK": str(i), "HOME": str(tmp_path / f"home{i}")}
        for d in ("tmp", "home"):
            (tmp_path / f"{d}{i}").mkdir()
        r = megacache("fingerprint", "--model", "dlrm", "--code", "abc123", env=host_env,
                      cwd=tmp_path / f"home{i}")
        assert r.returncode == 0, r.stderr
        outputs.append(r.stdout)
    assert outputs[0] == outputs[1]
    fp = json.loads(outputs[0])
    assert len(fp["key"]) == 64 and fp["model"] == "dlrm" and fp["code"] == "abc123"
    assert set(fp["hw"]) >= {"arch", "cpu_isa", "cxx", "gpu", "cc"}
    assert fp["env"]["torch"].startswith("2.")
    text = outputs[0]
    assert str(tmp_path) not in text and "node-" not in text
    hostname = socket.gethostname()
    if len(hostname) > 4:
        assert hostname not in text
    other = megacache("fingerprint", "--model", "dlrm", "--code", "abc124")
    assert json.loads(other.stdout)["key"] != fp["key"]


def test_push_ls_show_pull_stats(server: ServerProcess, tmp_path: Path):
    need("torch")
    env = {"MEGACACHE_URL": server.url, "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "node")}
    bundle = tmp_path / "bundle.bin"
    bundle.write_bytes(os.urandom(300_000))
    pushed = megacache("push", str(bundle), "--model", "cli-model", "--code", "c1",
                       "--cold-compile-s", "42", env=env)
    assert pushed.returncode == 0, pushed.stderr
    key = pushed.stdout.split()[1]
    listing = megacache("ls", "--model", "cli-model", env=env)
    row = listing.stdout.splitlines()[2].split()
    assert row[0] == key[:16] and "42.0" in row, listing.stdout
    assert row[4:6] == ["300.0", "kB"]  # a size in the unit it reads best in
    head, line = listing.stdout.splitlines()[0], listing.stdout.splitlines()[2]
    assert head.index("cold s") + 6 == line.index("42.0") + 4  # figures right-aligned
    shown = json.loads(megacache("show", row[0], env=env).stdout)  # the key as ls printed it
    assert shown["key"] == key and shown["cold_compile_s"] == 42.0
    assert shown["blobs"][0]["raw_size"] == 300_000
    env["MEGACACHE_NODE_CACHE_DIR"] = str(tmp_path / "other-node")  # another machine
    pulled = megacache("pull", row[0], env=env)
    assert pulled.returncode == 0 and "downloaded" in pulled.stdout
    assert "kB" in pulled.stderr and "0.0/0.0" not in pulled.stderr, pulled.stderr
    # not on a terminal (captured here): whole lines, never run together with `\r`
    assert "\r" not in pulled.stderr and pulled.stderr.count("\n") <= 5 * 2, pulled.stderr
    digest = shown["blobs"][0]["digest"]
    assert (tmp_path / "other-node" / "blobs" / digest).stat().st_size == shown["blobs"][0]["size"]
    again = megacache("pull", key, env=env)
    assert "already on node" in again.stdout
    run = {"key": key, "model": "cli-model", "outcome": "hit", "replay": "full",
           "tts_s": 12.0, "job_id": "cli-job", "attempt": 0, "rank": 0, "world_size": 1}
    assert httpx.post(f"{server.url}/v1/events", json=run, timeout=30).status_code == 202
    stats = megacache("stats", env=env)
    assert stats.returncode == 0 and "hit rate" in stats.stdout and "TOTAL" in stats.stdout
    assert "replayed full/part/rebuilt" in stats.stdout and "start p50 s" in stats.stdout
    row = next(line for line in stats.stdout.splitlines() if line.startswith("cli-model"))
    assert "1/0/0" in row.split(), row


@pytest.mark.parametrize("server", ["sqlite+fs"], indirect=True)  # the client's rule alone
def test_a_key_prefix_names_one_entry_or_lists_the_ones_it_could_be(server: ServerProcess):
    seen: dict[str, Fingerprint] = {}
    for i in itertools.count():  # two fingerprints whose keys share their first 4 hex digits
        fp = make_fingerprint(model="cli-prefix", code=f"c{i}")
        if (twin := seen.setdefault(fp.key()[:4], fp)) is not fp:
            break
    bundle = os.urandom(1000)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.put(f"/v1/cas/{sha256(bundle)}", content=bundle).status_code in (200, 201)
        for f in (twin, fp):
            m = make_manifest({"megacache": bundle}, f)
            assert client.put(f"/v1/ac/{m.key}", content=m.to_json(), headers={
                "content-type": "application/json"}).status_code in (200, 201)
    keys = sorted((twin.key(), fp.key()))
    env = {"MEGACACHE_URL": server.url}
    both = megacache("show", keys[0][:4], env=env)
    assert both.returncode == ExitCode.USAGE and "ambiguous" in both.stderr
    assert keys[0] in both.stderr and keys[1] in both.stderr
    unique = next(n for n in range(4, 64) if keys[0][:n] != keys[1][:n])
    shown = megacache("show", keys[1][:unique], env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["key"] == keys[1], shown.stderr
    absent = next(p for p in ("0000", "ffff") if not any(k.startswith(p) for k in keys))
    none = megacache("pull", absent, env=env)
    assert none.returncode == ExitCode.PROBLEM and f"starts with {absent}" in none.stderr


def test_cli_errors_are_clear(tmp_path: Path):
    """Each failure has its documented exit code (megacache_client.wire.exitcodes)."""
    r = megacache("ls")
    assert r.returncode == ExitCode.CONFIG and "MEGACACHE_URL" in r.stderr
    r = megacache("show", "not-a-key", "--help")
    assert r.returncode == 0
    r = megacache("--url", "http://127.0.0.1:1", "show", "nothex")
    assert r.returncode == ExitCode.USAGE and "64 lowercase hex" in r.stderr
    r = megacache("--url", "http://127.0.0.1:1", "pull", "abc")  # too short to be a prefix
    assert r.returncode == ExitCode.USAGE and "at least 4" in r.stderr
    r = megacache("ls", "--bogus-flag")
    assert r.returncode == ExitCode.USAGE
    r = megacache("--url", f"http://127.0.0.1:{free_port()}", "ls",
                  env={"MEGACACHE_RETRIES": "0"})
    assert r.returncode == ExitCode.UNAVAILABLE
    assert r.stderr.startswith("megacache: list entries")
    assert "Traceback" not in r.stderr


def test_autoload_install_and_remove(tmp_path: Path):
    r = megacache("autoload", "install", "--target", str(tmp_path))
    assert r.returncode == 0, r.stderr
    pth = tmp_path / "megacache_autoload.pth"
    assert pth.read_text() == (ROOT / "megacache_autoload.pth").read_text()
    megacache("autoload", "remove", "--target", str(tmp_path))
    assert not pth.exists()


def test_pth_costs_nothing_until_torch_is_imported(tmp_path: Path):
    """Every Python start runs the .pth line: without MEGACACHE_URL it imports nothing; with
    it, only the tiny hook module, and the client once torch has been imported."""
    code = ("import site, sys; site.addsitedir(sys.argv[1]); "
            "print('megacache_autoload' in sys.modules, 'megacache_client' in sys.modules, "
            "'httpx' in sys.modules, 'torch' in sys.modules)")
    (tmp_path / "megacache_autoload.pth").write_text((ROOT / "megacache_autoload.pth").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, env=env, check=True).stdout.split()
    assert out == ["False", "False", "False", "False"]
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, check=True,
                         env={**env, "MEGACACHE_URL": "http://127.0.0.1:1"}).stdout.split()
    assert out == ["True", "False", "False", "False"]


def test_version_is_the_package_version():
    from megacache_client import __version__

    r = megacache("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"megacache {__version__}"


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
    ("explain", ("--model", "--code", "--compile-mode", "--json")),
])
def test_cli_options_have_help(command: str, options: tuple[str, ...]):
    from megacache_client.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore
    helps = {opt: action.help for action in sub._actions for opt in action.option_strings}
    for option in options:
        assert helps[option], f"megacache {command} {option} has no help text"


# one backend: the rule is the client's, and each of its 5 processes imports torch
@pytest.mark.parametrize("server", ["sqlite+fs"], indirect=True)
def test_explain_claims_a_saving_only_for_what_a_job_would_load(server: ServerProcess,
                                                                 tmp_path: Path):
    """`megacache explain`: a hit names the entry and what it could save; a miss says what
    was missed and why, and claims nothing (exit 1); an unsupported torch is inert."""
    need("torch")
    env = {"MEGACACHE_URL": server.url, "MEGACACHE_NODE_CACHE_DIR": str(tmp_path / "node")}
    bundle = tmp_path / "bundle.bin"
    bundle.write_bytes(os.urandom(1000))
    pushed = megacache("push", str(bundle), "--model", "explained", "--code", "c1",
                       "--cold-compile-s", "42", env=env)
    assert pushed.returncode == 0, pushed.stderr
    hit = megacache("explain", "--model", "explained", "--code", "c1", env=env)
    assert hit.returncode == 0, hit.stderr
    assert "lookup       hit: exact fingerprint" in hit.stdout
    assert "up to 42.0 s of torch compile" in hit.stdout, hit.stdout
    fallback = megacache("explain", "--model", "explained", "--code", "c2", "--json", env=env)
    found = json.loads(fallback.stdout)
    assert fallback.returncode == 0 and found["outcome"] == "fallback", found
    assert found["differing"] == ["code"] and found["entry"]["code"] == "c1"
    # without --code the trainer's code is its model's source hash, which the command
    # cannot see: it says so, and never calls the entry a mere fallback for that alone
    auto = megacache("explain", "--model", "explained", env=env)
    assert auto.returncode == 0, auto.stderr
    assert "lookup       hit or fallback:" in auto.stdout, auto.stdout
    assert "code         automatic:" in auto.stdout and "'unknown'" not in auto.stdout
    miss = megacache("explain", "--model", "never-published", env=env)
    assert miss.returncode == 1, miss.stderr
    assert "lookup       miss: no entry for model 'never-published' yet" in miss.stdout
    assert "could save   nothing" in miss.stdout and "up to" not in miss.stdout
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.5.1"\n')
    inert = megacache("explain", "--model", "explained", "--code", "c1",
                      env={**env, "PYTHONPATH": f"{fake.parent}:{ROOT}"})
    assert inert.returncode == 1, inert.stderr
    assert "lookup       inert: torch 2.5.1 is outside the range" in inert.stdout, inert.stdout
    assert "could save   nothing" in inert.stdout
