from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from helpers import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real megacache-server on a free loopback port with the embedded defaults."""
    proc = ServerProcess(tmp_path_factory.mktemp("srv") / "data").start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a 1 MiB blob limit, a 3 MiB store budget and a 2 KiB manifest limit."""
    proc = ServerProcess(
        tmp_path_factory.mktemp("limited") / "data",
        "--max-blob-size", "1MiB", "--store-budget", "3MiB",
        env={"MEGACACHE_MAX_MANIFEST_SIZE": "2KiB"},
    ).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
