"""The server image built from docker/Dockerfile and run for real, and the compose scale stack
with real trainers (docker/smoke.sh), on rootful podman.

docker/local/setup.sh readies the machine once (podman, runc and debootstrap from the Debian
archive if missing; a debootstrap base image standing in for python:3.12-slim, built only if
absent). The image is built from the README's own `docker build` lines; the only additions
are the local base and the network flag (`--build-arg BASE_IMAGE`, `--network host`) and
podman's `--format docker` (its default OCI format drops HEALTHCHECK). Containers run the
README's `docker run` line with its name, volume and port swapped for a test's own: the host
network with the server on 127.0.0.1 and a free port, as no test binds anything else.
Every container and volume a test creates is removed at its end, pass or fail.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from conftest import ensure_tools, environment_missing
from filelock import FileLock
from helpers import free_port, make_fingerprint, make_manifest, sha256

from benchmarks.harness.servers import STARTED_GROUPS

pytestmark = [pytest.mark.e2e, pytest.mark.container]

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "docker" / "local" / "setup.sh"
SMOKE = ROOT / "docker" / "smoke.sh"
STATE = Path(os.environ.get("MEGACACHE_LOCAL_STATE", "/var/tmp/megacache-local"))
LOOPBACK = "127.0.0.1"


def readme_docker_lines() -> dict[str, list[list[str]]]:
    """The README's `docker build` / `run` / `exec` commands (Run in Docker), split."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Run in Docker\n", 1)[1].split("\n## ", 1)[0]
    found: dict[str, list[list[str]]] = {"build": [], "run": [], "exec": []}
    for line in section.splitlines():
        if line.startswith("docker ") and line.split()[1] in found:
            words = shlex.split(line, comments=True)
            found[words[1]].append(words)
    return found


class Podman:
    """The podman command with this machine's settings (setup.sh's CONTAINERS_CONF)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.base_image = env["MEGACACHE_BASE_IMAGE"]
        self.exe = shutil.which("podman", path=env.get("PATH")) or "podman"

    def __call__(self, *args: str, check: bool = True,
                 timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([self.exe, *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT)
        if check and r.returncode != 0:
            raise AssertionError(f"podman {shlex.join(args)} exited {r.returncode}:\n"
                                 f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return r

    def inspect(self, what: str, fmt: str) -> str:
        return self("inspect", "--format", fmt, what).stdout.strip()


@pytest.fixture(scope="session")
def podman() -> Podman:
    """podman ready to build and run: docker/local/setup.sh, which installs only what is
    missing and builds the base image only if its tag is absent (about 70 s the first time
    on a clean machine, 1 s after)."""
    if shutil.which("podman") is None and (os.geteuid() != 0 or not shutil.which("apt-get")):
        environment_missing("podman", "not installed, and not root with apt-get to install it "
                                      "(docker/local/setup.sh)")
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        environment_missing("podman (docker/local/setup.sh)", r.stderr[-3000:])
    env = dict(os.environ)
    env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
    for line in r.stdout.splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            key, _, value = words[1].partition("=")
            env[key] = value
    assert {"CONTAINERS_CONF", "MEGACACHE_BASE_IMAGE"} <= env.keys(), r.stdout
    return Podman(env)


@dataclass
class Image:
    tag: str
    build_s: float
    size: int


def build_from_readme(podman: Podman, tag: str) -> Image:
    """The README's `docker build` line for `tag`, run by podman with the local base."""
    lines = [w for w in readme_docker_lines()["build"] if w[w.index("-t") + 1] == tag]
    assert len(lines) == 1, f"the README has no single `docker build ... -t {tag}` line"
    words = lines[0]
    cmd = ["build", "--format", "docker", "--network", "host",
           "--build-arg", f"BASE_IMAGE={podman.base_image}", *words[2:]]
    with FileLock(str(STATE / "build.lock")):  # pytest -n: one build of a tag at a time
        old = podman("image", "inspect", "--format", "{{.Id}}", tag, check=False).stdout.strip()
        started = time.monotonic()
        podman(*cmd, timeout=900)
        build_s = time.monotonic() - started
        new = podman.inspect(tag, "{{.Id}}")
        if old and old != new:  # the image this build replaced, unless something uses it
            podman("rmi", old, check=False)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout)
    print(f"\n{tag}: built in {build_s:.1f} s, {size / 1e6:.0f} MB")
    return Image(tag, build_s, size)


@pytest.fixture(scope="session")
def server_image(podman: Podman) -> Image:
    return build_from_readme(podman, "megacache-server")


@pytest.fixture(scope="session")
def s3_image(podman: Podman) -> Image:
    return build_from_readme(podman, "megacache-server:s3")


@dataclass
class Containers:
    """The containers and volumes of one test, all removed when it ends."""

    podman: Podman
    prefix: str
    names: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    def volume(self) -> str:
        name = f"{self.prefix}-v{len(self.volumes)}"
        self.volumes.append(name)
        self.podman("volume", "create", name)
        return name

    def run_readme(self, volume: str, port: int, *command: str) -> str:
        """The README's `docker run` line, with this test's name and volume, and the host
        network with the server on 127.0.0.1:`port` in place of `-p`; `command` after the
        image replaces its CMD."""
        (words,) = readme_docker_lines()["run"]
        name = f"{self.prefix}-c{len(self.names)}"
        args: list[str] = []
        it = iter(words[2:])
        for word in it:
            if word == "--name":
                args += ["--name", name]
                next(it)
            elif word == "-p":
                next(it)
                args += ["--network", "host", "-e", f"MEGACACHE_HOST={LOOPBACK}",
                         "-e", f"MEGACACHE_PORT={port}"]
            elif word == "-v":
                args += ["-v", f"{volume}:{next(it).split(':', 1)[1]}"]
            else:
                args.append(word)
        self.names.append(name)
        self.podman("run", *args, *command)
        return name

    def token(self, name: str) -> str:
        """A token made as the README says: `docker exec <container> megacache-server token
        create ...` (its stdout is the token alone)."""
        (words,) = readme_docker_lines()["exec"]
        return self.podman("exec", name, *words[3:]).stdout.strip()

    def wait_healthy(self, name: str, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        logs = self.podman("logs", name, check=False)
        raise AssertionError(f"{name}: no /healthz in {timeout} s:\n{logs.stdout}{logs.stderr}")

    def remove_all(self) -> None:
        for name in self.names:
            self.podman("rm", "--force", "--volumes", "--time", "0", name, check=False)
        for volume in self.volumes:
            self.podman("volume", "rm", "--force", volume, check=False)
        left = self.podman("ps", "--all", "--format", "{{.Names}}", "--filter",
                           f"name={self.prefix}", check=False).stdout.split()
        assert not left, f"containers left behind: {left}"


@pytest.fixture
def containers(podman: Podman, request: pytest.FixtureRequest) -> Iterator[Containers]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    box = Containers(podman, f"mc-test-{os.getpid()}-{slug}")
    try:
        yield box
    finally:
        box.remove_all()


def dev_only_packages() -> set[str]:
    """Distributions the [dev] extra brings that no runtime extra does, and torch."""
    by_extra: dict[str, set[str]] = {}
    for req in metadata.requires("megacache") or []:
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")
        extra = re.search(r"extra == [\"']([^\"']+)", req)
        by_extra.setdefault(extra.group(1) if extra else "", set()).add(name)
    runtime = by_extra[""] | by_extra["server"] | by_extra["s3"]
    return (by_extra["dev"] - runtime - {"megacache"}) | {"torch", "triton"}


def test_the_image_is_lean_and_runs_as_non_root(podman: Podman, server_image: Image,
                                                s3_image: Image):
    base = int(podman("image", "inspect", "--format", "{{.Size}}",
                      podman.base_image).stdout)
    for image in (server_image, s3_image):
        (config,) = json.loads(podman("image", "inspect", image.tag).stdout)
        assert config["Config"]["User"] == "10001:10001"
        health = config["Healthcheck"]  # kept by --format docker
        assert "/healthz" in " ".join(health["Test"]), health
        out = podman("run", "--rm", "--network", "host", "--entrypoint", "sh", image.tag, "-c",
                     "id -u; for c in gcc cc g++ c++ clang make; do command -v $c; done; "
                     "pip list --format=freeze").stdout.split()
        assert out[0] == "10001", out
        installed = {line.split("==")[0].lower().replace("_", "-") for line in out[1:]}
        assert not [line for line in out[1:] if line.startswith("/")], \
            f"a compiler in {image.tag}: {out}"
        assert not installed & dev_only_packages(), installed & dev_only_packages()
        assert ("boto3" in installed) == image.tag.endswith(":s3"), installed
        # what the Dockerfile adds on top of its base: the service and its dependencies
        # (~110 MB); torch alone would be 700 MB more, a compiler toolchain 200 MB
        assert image.size - base < 200e6, (image.tag, image.size, base)


def test_the_readme_lines_serve_with_auth_and_keep_data(containers: Containers,
                                                        server_image: Image):
    volume, port = containers.volume(), free_port()
    url = f"http://{LOOPBACK}:{port}"
    name = containers.run_readme(volume, port)
    containers.wait_healthy(name, url)
    assert httpx.get(f"{url}/healthz").json()["status"] == "ok"

    data = os.urandom(200_000)
    manifest = make_manifest({"megacache": data}, make_fingerprint(code="container"))
    blob_url, entry_url = f"{url}/v1/cas/{sha256(data)}", f"{url}/v1/ac/{manifest.key}"
    # auth is on by default: nothing without a token
    assert httpx.put(blob_url, content=data).status_code == 401
    assert httpx.get(entry_url).status_code == 401
    auth = {"authorization": f"Bearer {containers.token(name)}"}
    assert httpx.put(blob_url, content=data, headers=auth).status_code == 201
    r = httpx.put(entry_url, content=manifest.to_json(),
                  headers={**auth, "content-type": "application/json"})
    assert r.status_code == 201, r.text

    def stored() -> None:
        assert httpx.get(blob_url, headers=auth).content == data
        got = httpx.get(entry_url, headers=auth)
        assert got.status_code == 200 and got.json() == json.loads(manifest.to_json())

    stored()
    containers.podman("restart", "--time", "10", name)
    containers.wait_healthy(name, url)
    stored()  # the same container again, and the token still valid
    # a new container on the volume (an upgrade): the data and the tokens are in /data
    containers.podman("rm", "--force", name)
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    blob_url, entry_url = f"{url}/v1/cas/{sha256(data)}", f"{url}/v1/ac/{manifest.key}"
    containers.wait_healthy(containers.run_readme(volume, port), url)
    stored()


def test_the_healthcheck_reports_healthy(containers: Containers, server_image: Image):
    port = free_port()
    name = containers.run_readme(containers.volume(), port)
    containers.wait_healthy(name, f"http://{LOOPBACK}:{port}")
    # podman without systemd has no timer to run the check: run it as `podman healthcheck
    # run` does for a timer, then read the verdict as `docker inspect` would
    r = containers.podman("healthcheck", "run", name, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert containers.podman.inspect(name, "{{.State.Health.Status}}") == "healthy"
    # and it checks something: a server on another port than MEGACACHE_PORT fails it
    probed, served = free_port(), free_port()
    other = containers.run_readme(containers.volume(), probed, "serve", "--port", str(served))
    containers.wait_healthy(other, f"http://{LOOPBACK}:{served}")
    r = containers.podman("healthcheck", "run", other, check=False)
    assert r.returncode == 1 and "unhealthy" in r.stdout, r.stdout + r.stderr


def test_sigterm_stops_it_in_seconds_and_loses_nothing(containers: Containers,
                                                       server_image: Image):
    volume, port = containers.volume(), free_port()
    url = f"http://{LOOPBACK}:{port}"
    name = containers.run_readme(volume, port)
    containers.wait_healthy(name, url)
    auth = {"authorization": f"Bearer {containers.token(name)}"}

    acked: list[bytes] = []
    stopping = threading.Event()

    def upload() -> None:
        """Writes until the server is gone; a write answered 201 must survive the stop."""
        with httpx.Client(timeout=10, headers=auth) as client:
            while not stopping.is_set():
                data = os.urandom(256 * 1024)
                try:
                    r = client.put(f"{url}/v1/cas/{sha256(data)}", content=data)
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                if r.status_code == 201:
                    acked.append(data)

    writer = threading.Thread(target=upload, daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 30
        while len(acked) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        manifest = make_manifest({"megacache": acked[0]}, make_fingerprint(code="sigterm"))
        r = httpx.put(f"{url}/v1/ac/{manifest.key}", content=manifest.to_json(),
                      headers={**auth, "content-type": "application/json"})
        assert r.status_code == 201, r.text
        started = time.monotonic()
        containers.podman("stop", "--time", "30", name)  # SIGTERM, SIGKILL after 30 s
        stop_s = time.monotonic() - started
    finally:
        stopping.set()
        writer.join(timeout=30)
    print(f"\nSIGTERM to exit: {stop_s:.2f} s, {len(acked)} uploads acknowledged")
    assert stop_s < 5, f"the server took {stop_s:.1f} s to stop"
    assert containers.podman.inspect(name, "{{.State.ExitCode}}") == "0"  # not SIGKILL's 137
    logs = containers.podman("logs", name)
    assert "Traceback" not in logs.stdout + logs.stderr, logs.stderr
    assert "Finished server process" in logs.stdout + logs.stderr

    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    again = containers.run_readme(volume, port)
    containers.wait_healthy(again, url)
    with httpx.Client(timeout=30, headers=auth) as client:
        for data in acked:
            r = client.get(f"{url}/v1/cas/{sha256(data)}")
            assert r.status_code == 200 and r.content == data
        assert client.get(f"{url}/v1/ac/{manifest.key}").status_code == 200
    fsck = containers.podman("exec", again, "megacache-server", "fsck", "--verify", check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_the_s3_variant_carries_the_s3_store(containers: Containers, s3_image: Image,
                                             server_image: Image):
    """The server,s3 image imports the S3 blob store (boto3 and all); the plain one has no
    boto3. The compose scale stack runs the s3 image against SeaweedFS (test_smoke_sh_local)."""
    probe = "import megacache_server.store.blobstore.s3, botocore; print(botocore.__version__)"
    out = containers.podman("run", "--rm", "--network", "none", "--entrypoint", "python",
                            s3_image.tag, "-c", probe)
    assert re.fullmatch(r"\d+\.\d+\.\d+\s*", out.stdout), out.stdout
    plain = containers.podman("run", "--rm", "--network", "none", "--entrypoint", "python",
                              server_image.tag, "-c", probe, check=False)
    assert plain.returncode == 1 and "No module named 'boto" in plain.stderr, plain.stderr


def project_leftovers(podman: Podman, project: str) -> list[str]:
    """Containers and volumes of a compose project still present (each then removed)."""
    label = f"label=com.docker.compose.project={project}"
    left = podman("ps", "--all", "--format", "{{.Names}}", "--filter", label).stdout.split()
    volumes = podman("volume", "ls", "--format", "{{.Name}}", "--filter", label).stdout.split()
    for name in left:
        podman("rm", "--force", "--volumes", "--time", "0", name, check=False)
    for volume in volumes:
        podman("volume", "rm", "--force", volume, check=False)
    return left + volumes


def engine_processes(project: str) -> list[str]:
    """podman's helper processes (conmon) still attached to a project's containers."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name = args[args.index(b"-n") + 1] if b"-n" in args[:-1] else b""
        if name.decode(errors="replace").startswith(project + "-"):
            found.append(f"{proc.name}: {b' '.join(args[:3]).decode(errors='replace')}")
    return found


def test_smoke_sh_local(podman: Podman, server_image: Image, tmp_path: Path):
    """docker/smoke.sh as an operator runs it here: the image alone, then the compose scale
    stack (Redis, SeaweedFS, two replicas, nginx; images built by compose from
    docker/compose.local.yaml) with a real torch.compile trainer on this host publishing
    through nginx, a second new machine starting warm, and one replica killed while the
    other serves every entry and blob (pulled, and fsck --verify)."""
    ensure_tools({"curl": "curl"})
    project = f"mc-smoke-{os.getpid()}"
    report = tmp_path / "report.json"
    env = {**podman.env, "SMOKE_PYTHON": sys.executable, "SMOKE_PROJECT": project,
           "SMOKE_REPORT": str(report), "TMPDIR": str(tmp_path)}
    env.pop("DOCKER_HOST", None)  # smoke.sh starts its own podman API socket
    proc = subprocess.Popen(["bash", str(SMOKE), "--local"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    STARTED_GROUPS.add(proc.pid)  # the suite's end checks nothing of it is left running
    try:
        out = proc.communicate(timeout=540)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # smoke.sh's trap takes the stack down
        out = proc.communicate(timeout=120)[0]
        raise AssertionError(f"smoke.sh took over 540 s:\n{out}") from None
    finally:
        left = project_leftovers(podman, project)
        deadline = time.monotonic() + 15  # a removed container's conmon exits in a moment
        while engine_processes(project) and time.monotonic() < deadline:
            time.sleep(0.5)
        lingering = engine_processes(project)
        for line in lingering:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert proc.returncode == 0, out
    assert not left, f"smoke.sh left {left}"
    assert not lingering, f"processes of smoke.sh's containers still running: {lingering}"
    figures = json.loads(report.read_text())
    print(f"\nsmoke.sh --local: {figures}")
    assert figures["entries"] >= 1 and figures["blobs"] >= 1, figures
    assert "warm run on a new machine hit" in out, out


def test_smoke_sh_refuses_unknown_arguments():
    r = subprocess.run(["bash", str(SMOKE), "--bogus"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2
    assert "unknown argument '--bogus'" in r.stderr


@pytest.mark.parametrize("rewrite, status, expected", [
    ("listen 8080; => listen 127.0.0.1:18788;\nreplica-1:8787 => 127.0.0.1:18790",
     0, "listen 127.0.0.1:18788;"),
    ("replica-9:8787 => 127.0.0.1:1", 2, "'replica-9:8787' is not in /etc/nginx/nginx.conf"),
    ("listen 8080;", 2, "no ' => ' in: listen 8080;"),
], ids=["rewritten", "absent", "malformed"])
def test_the_local_nginx_rewrite(podman: Podman, rewrite: str, status: int, expected: str):
    """compose.local.yaml's nginx: docker/nginx.conf rewritten literally, and a rewrite
    that matches nothing (nginx.conf changed under it) is an error, not a silent no-op."""
    entrypoint = ROOT / "docker" / "local" / "nginx-entrypoint.sh"
    r = podman("run", "--rm", "--network", "none",
               "-v", f"{entrypoint}:/entrypoint.sh:ro",
               "-v", f"{ROOT / 'docker' / 'nginx.conf'}:/etc/nginx/nginx.conf:ro",
               "-e", f"MEGACACHE_NGINX_REWRITE={rewrite}", podman.base_image,
               "bash", "/entrypoint.sh", "cat", "/tmp/nginx.conf", check=False)
    assert r.returncode == status, r.stdout + r.stderr
    assert expected in (r.stdout if status == 0 else r.stderr), r.stdout + r.stderr
    if status == 0:
        assert "server 127.0.0.1:18790 max_fails" in r.stdout
        assert "server replica-2:8787" in r.stdout  # what was not asked for stays
