"""Eviction and garbage collection rules, on every index + blob store pair."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from conftest import BACKENDS, backend_args
from helpers import ServerProcess, make_fingerprint, make_manifest, sha256

from megacache_client.wire.manifest import Manifest, component_digest
from megacache_server.service.housekeeping import eviction
from megacache_server.settings import Settings
from megacache_server.store.index.base import NewEntry, Precondition
from megacache_server.store.storage import Storage, build_storage


@pytest.fixture(params=BACKENDS)
def settings(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Settings:
    args, env = backend_args(request.param, request)
    values: dict[str, object] = {"data_dir": tmp_path / "data"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        values[flag.removeprefix("--").replace("-", "_")] = value
    for name, value in env.items():
        if name.startswith("MEGACACHE_"):
            values[name.removeprefix("MEGACACHE_").lower()] = value
        else:
            monkeypatch.setenv(name, value)
    return Settings(**values)  # type: ignore[arg-type]


def run(settings: Settings, scenario: Callable[[Storage], Awaitable[None]]) -> None:
    async def main() -> None:
        storage = build_storage(settings)
        await storage.open()
        try:
            await scenario(storage)
        finally:
            await storage.close()

    asyncio.run(main())


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def add_blob(storage: Storage, data: bytes) -> str:
    digest = sha256(data)
    await storage.blobs.put(digest, len(data), _chunks(data))
    await storage.index.record_blob(digest, len(data), "default")
    return digest


async def add_entry(storage: Storage, manifest: Manifest) -> None:
    await storage.index.touch_blobs([b.digest for b in manifest.blobs])
    fp = manifest.fingerprint
    await storage.index.put(NewEntry(
        key=manifest.key, manifest_json=manifest.to_json(), namespace=fp.namespace,
        model=fp.model, env_digest=component_digest(fp.env), hw_digest=component_digest(fp.hw),
        digests=tuple(b.digest for b in manifest.blobs),
        size=sum(b.size for b in manifest.blobs), created_at=manifest.created_at.timestamp()),
        Precondition())


async def entries_with_own_blobs(storage: Storage, n: int, size: int = 1000) -> list[Manifest]:
    made = []
    for i in range(n):
        data = os.urandom(size)
        await add_blob(storage, data)
        m = make_manifest({"megacache": data}, make_fingerprint(code=f"e{i}"))
        await add_entry(storage, m)
        made.append(m)
        await asyncio.sleep(0.02)  # distinct access times
    return made


def test_over_budget_evicts_least_recently_used_first(settings: Settings):
    async def scenario(storage: Storage) -> None:
        e = await entries_with_own_blobs(storage, 4)
        await storage.index.get(e[0].key)  # the oldest entry is used again: now the newest
        plan = await eviction.plan(storage, budget=3000, grace_s=0, low_water=0.9)
        assert [k for k, _ in plan.evict] == [e[1].key, e[2].key]  # 4000 → 2000 ≤ 2700
        assert {d.digest for d in plan.delete} == {e[1].blobs[0].digest, e[2].blobs[0].digest}
        done = await eviction.apply(storage, plan)
        assert (done.evicted, done.deleted, done.freed_bytes) == (2, 2, 2000)
        assert await storage.index.get(e[1].key) is None
        assert await storage.index.get(e[0].key) is not None
        assert await storage.blobs.stat(e[1].blobs[0].digest) is None
        assert await storage.blobs.stat(e[0].blobs[0].digest) == 1000
        assert await storage.index.stored_bytes() == 2000
        assert (await storage.index.usage())[0] == 2

    run(settings, scenario)


def test_blobs_of_a_live_job_resolution_are_never_collected(settings: Settings):
    """Eviction passes over an entry a live resolution holds (evicting it frees nothing),
    and a held blob no entry names any more stays, until the resolution expires; apply
    re-checks holds made after the plan."""
    async def scenario(storage: Storage) -> None:
        e = await entries_with_own_blobs(storage, 3)
        now = time.time()
        held = await storage.index.get(e[0].key, touch=False)
        await storage.index.resolve("default", "job", 0, e[0].key, held, 600, now)
        plan = await eviction.plan(storage, budget=2000, grace_s=0, low_water=0.5, now=now)
        assert [k for k, _ in plan.evict] == [e[1].key, e[2].key]
        await storage.index.delete(e[0].key)  # the entry goes; its held blob stays
        plan = await eviction.plan(storage, budget=None, grace_s=0, now=now + 1)
        assert plan.delete == [] and plan.kept_held == 1
        stale = await eviction.plan(storage, budget=None, grace_s=0, now=now + 10**5)
        assert [d.digest for d in stale.delete] == [e[0].blobs[0].digest]
        done = await eviction.apply(storage, stale)  # the hold is still live: spared
        assert (done.deleted, done.spared) == (0, 1)
        assert await storage.blobs.stat(e[0].blobs[0].digest) == 1000

    run(settings, scenario)


def test_pinned_entries_are_never_evicted(settings: Settings):
    async def scenario(storage: Storage) -> None:
        e = await entries_with_own_blobs(storage, 3)
        assert await storage.index.set_pinned(e[0].key, True)
        plan = await eviction.plan(storage, budget=2000, grace_s=0, low_water=0.5)
        assert [k for k, _ in plan.evict] == [e[1].key, e[2].key]
        for m in e:
            await storage.index.set_pinned(m.key, True)
        plan = await eviction.plan(storage, budget=10, grace_s=0)
        assert plan.evict == [] and plan.delete == []
        assert not await storage.index.set_pinned("0" * 64, True)

    run(settings, scenario)


def test_unreferenced_blobs_wait_out_the_grace_period(settings: Settings):
    async def scenario(storage: Storage) -> None:
        orphan = await add_blob(storage, os.urandom(500))
        [kept] = await entries_with_own_blobs(storage, 1)
        plan = await eviction.plan(storage, budget=None, grace_s=3600)
        assert plan.delete == [] and plan.kept_in_grace == 1
        plan = await eviction.plan(storage, budget=None, grace_s=0.0, now=time.time() + 1)
        assert [(d.digest, d.why) for d in plan.delete] == [(orphan, "no entry names it")]
        await eviction.apply(storage, plan)
        assert await storage.blobs.stat(orphan) is None
        assert await storage.blobs.stat(kept.blobs[0].digest) is not None

    run(settings, scenario)


def test_a_blob_named_after_planning_is_spared(settings: Settings):
    async def scenario(storage: Storage) -> None:
        data = os.urandom(700)
        digest = await add_blob(storage, data)
        await asyncio.sleep(0.05)
        plan = await eviction.plan(storage, budget=None, grace_s=0.01)
        assert [d.digest for d in plan.delete] == [digest]
        # a manifest naming it is written between plan and apply
        await add_entry(storage, make_manifest({"megacache": data},
                                               make_fingerprint(code="late")))
        done = await eviction.apply(storage, plan)
        assert (done.deleted, done.spared) == (0, 1)
        assert await storage.blobs.stat(digest) == 700

    run(settings, scenario)


def test_blobs_are_deleted_in_batches(settings: Settings):
    """GC deletes many blobs per call (S3: one DeleteObjects per thousand); a blob that is
    already gone counts as deleted, and the store reports none as failed."""
    async def scenario(storage: Storage) -> None:
        digests = [await add_blob(storage, os.urandom(64)) for _ in range(5)]
        gone = "0" * 64
        assert await storage.blobs.delete_many([*digests[:4], gone]) == set()
        assert [await storage.blobs.stat(d) for d in digests] == [None] * 4 + [64]

    run(settings, scenario)


def test_a_blob_the_store_cannot_delete_keeps_its_record(tmp_path: Path):
    """The index forgets a blob only once the store has really deleted it: one it could not
    delete stays on record (the next GC tries again) and the GC reports it."""
    async def scenario(storage: Storage) -> None:
        stuck, fine = [await add_blob(storage, os.urandom(300)) for _ in range(2)]
        path = storage.blobs.path_of(stuck)  # type: ignore[attr-defined]
        path.unlink()
        path.mkdir()  # unlink() now fails with an OSError that is not "not found"
        plan = await eviction.plan(storage, budget=None, grace_s=0.0, now=time.time() + 1)
        assert {d.digest for d in plan.delete} == {stuck, fine}
        done = await eviction.apply(storage, plan)
        assert (done.deleted, done.failed, done.freed_bytes) == (1, 1, 300)
        assert await storage.index.blob_record(stuck) is not None
        assert await storage.index.blob_record(fine) is None
        assert await storage.index.stored_bytes() == 300

    run(Settings(data_dir=tmp_path / "data"), scenario)


def test_a_shared_blob_stays_while_any_entry_names_it(settings: Settings):
    async def scenario(storage: Storage) -> None:
        shared, a, b = os.urandom(2000), os.urandom(100), os.urandom(100)
        for data in (shared, a, b):
            await add_blob(storage, data)
        ma = make_manifest({"megacache": a, "toolchain": shared}, make_fingerprint(code="a"))
        await add_entry(storage, ma)
        await asyncio.sleep(0.02)
        mb = make_manifest({"megacache": b, "toolchain": shared}, make_fingerprint(code="b"))
        await add_entry(storage, mb)
        plan = await eviction.plan(storage, budget=2150, grace_s=0, low_water=1.0)
        assert [k for k, _ in plan.evict] == [ma.key]
        assert [d.digest for d in plan.delete] == [sha256(a)]  # not the shared one

    run(settings, scenario)


def test_budget_crossed_with_every_blob_in_grace_evicts_only_what_it_needs(settings: Settings):
    """Over budget with every blob in its grace period: the blobs of the entries eviction
    takes still count as freed, so it takes only as many as bring the store under the
    low-water mark, not every entry for nothing freed."""
    async def scenario(storage: Storage) -> None:
        e = await entries_with_own_blobs(storage, 20)
        stored = await storage.index.stored_bytes()
        plan = await eviction.plan(storage, budget=stored - 1, grace_s=3600, low_water=0.9)
        target = int((stored - 1) * 0.9)
        # 20 000 -> at most 17 999: the three least recently used entries, nothing more
        assert [k for k, _ in plan.evict] == [m.key for m in e[:3]]
        assert {d.digest for d in plan.delete} == {m.blobs[0].digest for m in e[:3]}
        done = await eviction.apply(storage, plan)
        assert (done.evicted, done.deleted, done.freed_bytes) == (3, 3, 3000)
        assert await storage.index.stored_bytes() <= target
        assert (await storage.index.usage())[0] == 17
        for m in e[3:]:
            assert await storage.index.get(m.key, touch=False) is not None
            assert await storage.blobs.stat(m.blobs[0].digest) == 1000

    run(settings, scenario)


def test_an_entry_whose_blobs_cannot_be_freed_is_not_evicted(settings: Settings):
    async def scenario(storage: Storage) -> None:
        shared, own = os.urandom(3000), os.urandom(500)
        await add_blob(storage, shared)
        await add_blob(storage, own)
        only_shared = make_manifest({"megacache": shared}, make_fingerprint(code="old"))
        await add_entry(storage, only_shared)  # least recently used, but its blob stays
        await asyncio.sleep(0.02)
        pinned = make_manifest({"megacache": shared}, make_fingerprint(code="pinned"))
        await add_entry(storage, pinned)
        assert await storage.index.set_pinned(pinned.key, True)
        await asyncio.sleep(0.02)
        newer = make_manifest({"megacache": own}, make_fingerprint(code="newer"))
        await add_entry(storage, newer)
        plan = await eviction.plan(storage, budget=3400, grace_s=3600, low_water=1.0)
        assert [k for k, _ in plan.evict] == [newer.key]
        assert [d.digest for d in plan.delete] == [sha256(own)]
        done = await eviction.apply(storage, plan)
        assert (done.evicted, done.freed_bytes) == (1, 500)
        assert await storage.index.get(only_shared.key, touch=False) is not None

    run(settings, scenario)


def publish_entries(c: httpx.Client, n: int, size: int, code: str) -> list[str]:
    """`n` entries with a blob of `size` bytes each, oldest first (distinct access times)."""
    keys = []
    for i in range(n):
        data = os.urandom(size)
        assert c.put(f"/v1/cas/{sha256(data)}", content=data).status_code == 201
        m = make_manifest({"megacache": data}, make_fingerprint(code=f"{code}{i}"))
        assert c.put(f"/v1/ac/{m.key}", content=m.to_json()).status_code == 201
        keys.append(m.key)
        time.sleep(0.02)
    return keys


def test_upload_over_budget_within_grace_evicts_one_entry_and_succeeds(tmp_path: Path):
    """The default one-hour grace period: blobs of a fresh store are all recent."""
    server = ServerProcess(tmp_path / "data", "--store-budget", "3MiB").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            keys = publish_entries(c, 5, 600 * 1024, "g")
            extra = os.urandom(600 * 1024)
            assert c.put(f"/v1/cas/{sha256(extra)}", content=extra).status_code == 201
            present = [c.get(f"/v1/ac/{k}").status_code for k in keys]
            # 3000 KiB + 600 KiB over 3 MiB: room for 600 KiB under 90 % of the rest
            assert present[0] == 404 and present[-2:] == [200, 200], present
            assert present.count(404) <= 2, present
    finally:
        server.stop()


def test_budget_pressure_at_upload_evicts_instead_of_refusing(tmp_path: Path):
    server = ServerProcess(tmp_path / "data", "--store-budget", "3MiB",
                           env={"MEGACACHE_GC_GRACE_S": "0"}).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            keys = publish_entries(c, 3, 1000 * 1024, "u")
            assert c.put(f"/v1/ac/{keys[0]}/pin").status_code == 204
            extra = os.urandom(600 * 1024)
            assert c.put(f"/v1/cas/{sha256(extra)}", content=extra).status_code == 201
            assert c.get(f"/v1/ac/{keys[0]}").status_code == 200  # pinned
            assert c.get(f"/v1/ac/{keys[1]}").status_code == 404  # least recently used
            assert c.get(f"/v1/ac/{keys[2]}").status_code == 200
            assert c.put(f"/v1/ac/{'0' * 64}/pin").status_code == 404
    finally:
        server.stop()


def test_gc_command_dry_run_then_apply(tmp_path: Path):
    data_dir = tmp_path / "data"
    server = ServerProcess(data_dir).start()
    orphan = os.urandom(1234)
    with httpx.Client(base_url=server.url) as c:
        c.put(f"/v1/cas/{sha256(orphan)}", content=orphan)
    server.stop()

    def gc(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "megacache_server", "gc", "--data-dir",
                              str(data_dir), *args], capture_output=True, text=True,
                             env={**os.environ, "MEGACACHE_GC_GRACE_S": "0"}, check=True)
        return out.stdout

    dry = gc("--dry-run")
    assert f"delete blob {sha256(orphan)}  1234 bytes  no entry names it" in dry
    assert "dry run: would evict 0 entries and delete 1 blobs (1234 bytes)" in dry
    assert (data_dir / "cas" / sha256(orphan)[:2] / sha256(orphan)).exists()
    assert "deleted 1 blobs (1234 bytes)" in gc()
    assert not (data_dir / "cas" / sha256(orphan)[:2] / sha256(orphan)).exists()
    # what the server's GC child prints: one JSON line
    assert json.loads(gc("--json")) == {"evicted": 0, "deleted": 0, "freed_bytes": 0,
                                         "spared": 0, "failed": 0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_background_gc_evicts_over_budget_and_stops_with_the_server(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest):
    """The server's periodic GC runs in a child process that opens the storage from the
    server's settings: it evicts what a lowered budget no longer holds, in LRU order,
    /metrics counts it, and the server stops cleanly."""
    args, env = backend_args(backend, request)
    data_dir = tmp_path / "data"
    server = ServerProcess(data_dir, *args, env=env).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        keys = publish_entries(c, 4, 100 * 1024, "bg")
        assert c.get(f"/v1/ac/{keys[0]}").status_code == 200  # used again: now the newest
    server.stop()
    server = ServerProcess(data_dir, *args, "--store-budget", "250KiB", env={
        **env, "MEGACACHE_GC_INTERVAL_S": "0.2", "MEGACACHE_GC_GRACE_S": "0"}).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            deadline = time.monotonic() + 30
            evicted = 0.0
            while evicted < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
                evicted = next((float(line.split()[-1]) for line in
                                c.get("/metrics").text.splitlines()
                                if line.startswith('megacache_evictions_total{kind="entry"}')),
                               0.0)
            # 400 KiB over a 250 KiB budget: LRU entries go until 90% of it (225 KiB) holds
            present = [c.get(f"/v1/ac/{k}").status_code for k in keys]
            assert (evicted, present) == (2, [200, 404, 404, 200]), (evicted, present)
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()
