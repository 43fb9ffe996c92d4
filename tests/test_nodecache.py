"""The node cache (`transport/nodecache.py`): one download for every rank of a node."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from helpers import sha256

from megacache_client.transport.nodecache import NodeCache


def test_node_cache_downloads_once_for_many_ranks(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    from megacache_client.transport import nodecache

    data = os.urandom(100_000)
    digest = sha256(data)
    calls = []
    at_lock: list[str] = []  # ranks that reached the blob's lock
    arrived = threading.Condition()
    file_lock = nodecache.FileLock

    class WatchedLock:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.lock = file_lock(*args, **kwargs)

        def __enter__(self) -> object:
            with arrived:
                at_lock.append(threading.current_thread().name)
                arrived.notify_all()
            return self.lock.__enter__()

        def __exit__(self, *exc: object) -> None:
            self.lock.__exit__(*exc)

    def download(tmp: Path) -> None:
        calls.append(1)
        with arrived:  # every other rank is at the lock before this download ends
            assert arrived.wait_for(lambda: len(at_lock) >= 4, timeout=20), at_lock
        tmp.write_bytes(data)

    monkeypatch.setattr(nodecache, "FileLock", WatchedLock)
    cache = NodeCache(tmp_path)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        NodeCache(tmp_path).fetch(digest, len(data), download))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(n for _, n in results) == [0, 0, 0, len(data)]
    # a copy corrupted on disk is detected and fetched again
    cache.path(digest).write_bytes(b"rot" + data[3:])
    path, n = cache.fetch(digest, len(data), download)
    assert n == len(data) and path.read_bytes() == data and len(calls) == 2
