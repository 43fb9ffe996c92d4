from __future__ import annotations

import faulthandler
import importlib
import itertools
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import NoReturn, TextIO, TypeVar

import httpx
import pytest
from file_seconds import recorded  # the file order's record, read and refreshed
from filelock import FileLock
from helpers import ServerProcess

from benchmarks.harness.machines import build_toolchain
from benchmarks.harness.servers import LocalRedis, LocalSeaweedS3, leftover_groups
from megacache_server.store.index.base import Index
from megacache_server.store.index.sqlite import SqliteIndex

_names = itertools.count()

SCRATCH = Path(__import__("tempfile").mkdtemp(prefix="megacache-tests-"))
"""This test process's temp dir for what the code under test leaves in TMPDIR (torchrun's
`torchelastic_*` dirs, a child's caches) and for torch's Inductor cache of compiles run in
the test process: set before anything imports torch, removed when the session ends, so a
passing run leaves nothing in the temp dir (pytest's own tmp_path dirs go by its retention
policy, pyproject.toml)."""
os.environ["TMPDIR"] = str(SCRATCH)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(SCRATCH / "torchinductor"))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
"""Inductor compiles in the compiling process, here and in every job a test starts
(`benchmarks.harness.machines.clean_env` passes it on): its default worker pool starts
processes that import torch in every cold compile, ~7 of a tiny model's ~21 s of CPU on
these 2 cores (measured: a two-layer MLP, 21.2 s against 14.0 s), which the suite's
compiles, many and side by side, pay in wall time. Torch's cache keys leave the setting out
(`compile_threads` is in `_cache_config_ignore_prefix`) and so does the fingerprint. The
modules that run jobs as a user does (the corpus, machine A/B, the demo) keep torch's pool:
`torch_s_own_compile_threads`."""


@pytest.fixture(scope="module")
def torch_s_own_compile_threads() -> Iterator[None]:
    """The module's jobs compile with Inductor's default worker pool, as a user's do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
        yield


def environment_missing(what: str, why: object) -> NoReturn:
    """The one way a test gives up on its environment: in CI (`CI=true`) a missing part fails
    the run, so a broken CI image cannot pass by skipping; elsewhere the test skips and says
    why. Works in a test, a fixture or at module level. tests/test_environment.py keeps
    every other skip out of tests/."""
    __tracebackhide__ = True  # a skip is reported at the test that asked, not here
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} is required in CI but unavailable: {why}")
    pytest.skip(f"{what} unavailable: {why}", allow_module_level=True)


def need(module: str, why: str = "") -> ModuleType:
    """`module` imported, or the test failed (CI) / skipped (elsewhere) saying why not."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        environment_missing(f"the Python module {module}" + (f" ({why})" if why else ""), exc)


def ensure_tools(packages: dict[str, str]) -> None:
    """Debian packages for missing tools ({tool: package}), installed when we are root (as
    CI is); a tool still missing fails the test in CI and skips it on a laptop."""
    __tracebackhide__ = True
    import shutil
    import subprocess

    def missing() -> list[str]:
        return [t for t in packages
                if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]

    if missing() and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq",
                        *sorted({packages[t] for t in missing()})],
                       env=env, capture_output=True, timeout=900)
    if missing():
        environment_missing(", ".join(missing()),
                            f"not installed (apt-get install {' '.join(packages.values())})")


S = TypeVar("S", LocalRedis, LocalSeaweedS3)


def started(service: S, what: str) -> S:
    """`service` started, or the test failed (CI) / skipped (laptop) saying why not."""
    __tracebackhide__ = True
    try:
        return service.start()
    except (FileNotFoundError, RuntimeError) as exc:
        environment_missing(what, exc)


@pytest.fixture
def hanging_server() -> Iterator[str]:
    """A URL whose server accepts connections and never answers (a stuck cache server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


SESSION_DIRS = ("redis", "seaweed")
"""The temp dirs of the session's services (below): they outlive every module."""


@pytest.fixture(scope="module", autouse=True)
def module_temp_removed(request: pytest.FixtureRequest,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What a module's fixtures made in the temp dir (servers' stores, machines' caches)
    goes when the module ends, unless one of its tests failed (then it stays for a look).
    tmp_path_retention_policy (pyproject.toml) removes a passed test's tmp_path only; left
    to the end of the run, the modules' dirs held ~2 GB at once. Set up before the
    module's other fixtures, so torn down after them: their servers have stopped."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        return
    for path in set(base.iterdir()) - before:
        if path.is_dir() and not path.is_symlink() \
                and path.name.rstrip("0123456789") not in SESSION_DIRS:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def toolchain(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """Torch's CPU toolchain for this host (ISA probe libraries, precompiled header), built
    once per run and shared by pytest-xdist's workers, for `Machine(..., toolchain=...)`:
    a producer that starts on it skips ~12 s of g++ that no test of it examines. Tests
    whose claim is what a machine builds, or what megacache ships it, start without it."""
    base = tmp_path_factory.getbasetemp()  # a worker's is in the run's, which is removed
    where = (base if worker_id == "master" else base.parent) / "toolchain"
    with FileLock(f"{where}.lock"):
        if not (where / "built").exists():
            shutil.rmtree(where, ignore_errors=True)
            build_toolchain(where)
            (where / "built").touch()
    return where


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A real redis-server of our own on a free loopback port."""
    redis = started(LocalRedis(tmp_path_factory.mktemp("redis")), "redis-server")
    yield redis
    redis.stop()


@pytest.fixture(scope="session")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweedS3]:
    """A real S3-compatible store (SeaweedFS) on a free loopback port."""
    weed = started(LocalSeaweedS3(tmp_path_factory.mktemp("seaweed")), "SeaweedFS (weed)")
    yield weed
    weed.stop()


def backend_args(backend: str, request: pytest.FixtureRequest
                 ) -> tuple[list[str], dict[str, str]]:
    """Server flags and environment for a `index+blobstore` backend pair."""
    index, blobs = backend.split("+")
    args: list[str] = []
    env: dict[str, str] = {}
    n = next(_names)
    if index == "redis":
        redis: LocalRedis = request.getfixturevalue("redis_service")
        args += ["--index", f"redis://127.0.0.1:{redis.port}/0"]
        env["MEGACACHE_REDIS_PREFIX"] = f"t{n}:"
    if blobs == "s3":
        s3: LocalSeaweedS3 = request.getfixturevalue("s3_service")
        args += ["--blob-store", "s3", "--s3-endpoint", s3.endpoint,
                 "--s3-bucket", f"test-bucket-{n}"]
        env.update({"MEGACACHE_S3_CREATE_BUCKET": "true", "AWS_ACCESS_KEY_ID": "test",
                    "AWS_SECRET_ACCESS_KEY": "test"})
    return args, env


BACKENDS = ["sqlite+fs", "redis+s3"]


def _configured(proc: ServerProcess, backend: str, args: list[str]) -> ServerProcess:
    """Tell the test-side helper where the server keeps its blobs."""
    proc.backend = backend
    if "--s3-endpoint" in args:
        proc.s3_endpoint = args[args.index("--s3-endpoint") + 1]
        proc.s3_bucket = args[args.index("--s3-bucket") + 1]
    return proc


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real megacache-server on a free loopback port, once per storage backend pair."""
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(tmp_path_factory.mktemp("srv") / "data", *args, env=env),
                       request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module", params=BACKENDS)
def limited_server(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a 1 MiB blob limit, a 3 MiB store budget and a 2 KiB manifest limit."""
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("limited") / "data", *args,
        "--max-blob-size", "1MiB", "--store-budget", "3MiB",
        env={"MEGACACHE_MAX_MANIFEST_SIZE": "2KiB", "MEGACACHE_NAMESPACE_PENDING_BYTES": "4MiB",
             **env},
    ), request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module", params=BACKENDS)
def events_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with auth on and events unthrottled: tenants post many runs in a test."""
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("events") / "data", *args, "--auth",
        env={**env, "MEGACACHE_TOKEN_CACHE_S": "0", "MEGACACHE_EVENT_RATE": "1000",
             "MEGACACHE_EVENT_BURST": "1000"}), request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(params=["sqlite", "redis"])
def make_index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Index]]:
    """A maker of index clients on one fresh store, once per index backend (the contract
    tests of every index protocol run on both)."""
    if request.param == "sqlite":
        yield lambda: SqliteIndex(tmp_path / "index.sqlite3")
        return
    from megacache_server.store.index.redis import RedisIndex

    redis: LocalRedis = request.getfixturevalue("redis_service")
    prefix = f"index{next(_names)}:"
    yield lambda: RedisIndex(f"redis://127.0.0.1:{redis.port}/0", prefix=prefix)


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No server, Redis or SeaweedFS process a test started may outlive the suite. Under
    pytest-xdist (`-n 2`) each worker checks its own processes and tells the controller,
    whose exit status is the run's."""
    if session.testsfailed == 0:
        shutil.rmtree(SCRATCH, ignore_errors=True)
    left = leftover_groups() + session.config.stash.get(_LEFT_BY_WORKERS, [])
    if left:
        print(f"\nprocess groups left running by the tests (now killed): {left}",
              file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker
            workeroutput["leftover_groups"] = left


_LEFT_BY_WORKERS = pytest.StashKey[list[int]]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist's controller: a worker has finished; keep what it left running."""
    left = getattr(node, "workeroutput", {}).get("leftover_groups", [])
    config: pytest.Config = node.config  # type: ignore[attr-defined]
    config.stash[_LEFT_BY_WORKERS] = config.stash.get(_LEFT_BY_WORKERS, []) + left


HANG_MARGIN_S = float(os.environ.get("MEGACACHE_TEST_HANG_MARGIN_S", "120"))
"""How long past pytest-timeout's limit a test may go before the watchdog ends its process
(the environment variable is for the watchdog's own test)."""
IDLE_LIMIT_S = 30 * 60.0
"""A process that ran a test and waits this long for the next (or its shutdown) is stuck."""
CI_RUN_LIMIT_S = 80 * 60.0
"""In CI, the run's controller ends itself with its stacks before CI's own 90 min limit."""

_WATCHDOG_OUT = pytest.StashKey[TextIO]()


def _watch(config: pytest.Config, seconds: float) -> None:
    """(Re)arm faulthandler's watchdog: past `seconds` it writes every thread's traceback to
    the real stderr and ends the process. It is a C thread, so it fires where SIGALRM
    cannot (a test stuck in C code, cleanup blocking after pytest-timeout's one alarm)."""
    out = config.stash.get(_WATCHDOG_OUT, None)
    if out is not None and seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=out)


def pytest_configure(config: pytest.Config) -> None:
    """Keep a copy of the real stderr for the watchdog (pytest captures fd 2 during a test;
    a dump written there would go with the process). In CI the controller of the run is
    watched as a whole: a stuck run ends with its stacks printed, not at CI's limit.
    pytest-xdist hands out files in the collection's order (`pytest_collection_modifyitems`
    below), not its own (most tests first); set here, not in addopts, so that a run without
    xdist (the dependency floors' venv) still parses its options."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    config.stash[_WATCHDOG_OUT] = os.fdopen(os.dup(2), "w")
    if os.environ.get("CI", "").lower() == "true" and not hasattr(config, "workerinput"):
        _watch(config, CI_RUN_LIMIT_S)


def pytest_unconfigure(config: pytest.Config) -> None:
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A hang pytest-timeout cannot break ends the process, with every thread's stack.

    pytest-timeout raises in the main thread by SIGALRM: a test stuck in C code (a lock
    taken without the GIL, a child's pipe) never sees it, nor does cleanup that blocks
    after its one alarm, and the whole run would wait for CI's limit with no clue (one
    stop's CI waited 65 min with 5 tests unreported). Past the limit plus a margin the
    watchdog ends the worker; pytest-xdist reports the test as crashed, names it, and runs
    the rest on a new worker. Between tests the process is watched for IDLE_LIMIT_S."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout") or 0)
    if limit > 0:
        _watch(item.config, limit + HANG_MARGIN_S)
    else:  # pytest-timeout off for this test: only the idle watch stands
        faulthandler.cancel_dump_traceback_later()
    try:
        yield
    finally:
        _watch(item.config, IDLE_LIMIT_S)


UNKNOWN_FILE_S = 5.0


@pytest.hookimpl(trylast=True)  # after pytest's own reordering within a file
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, by `tests/file_seconds.json` (`--dist loadfile` hands out
    whole files, in this order: `pytest_configure` turns xdist's reorder off):
    pytest-xdist's own order, most tests first, started the chaos run's four tests (6 min)
    last, and a run waited on one worker for its tail. A sort that keeps each file's tests
    in their order; files outside the record go after those above UNKNOWN_FILE_S, by name."""
    seconds = recorded()
    items.sort(key=lambda item: (-float(seconds.get(item.path.name, UNKNOWN_FILE_S)),
                                 item.path.name))
