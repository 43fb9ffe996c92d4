"""One contract per storage protocol, run against every index backend (SQLite and Redis).

The cache service relies on exactly these behaviours; a new backend passes this file or it
is not a backend.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from helpers import run

from benchmarks.harness.servers import LocalRedis
from megacache_client.wire.events import Event
from megacache_client.wire.schema import parse_json
from megacache_server.errors import PreconditionFailed
from megacache_server.store.index.base import (
    MAX_CLAIM_LEASE_S,
    MAX_RESOLUTION_TTL_S,
    Index,
    NewEntry,
    Precondition,
    StoredEntry,
    TokenRecord,
)

INDEXES = ["sqlite", "redis"]
_n = iter(range(10**6))


def entry(key: str, *, namespace: str = "ns", model: str = "m", env: str = "e", hw: str = "h",
          digests: tuple[str, ...] = ("d1",), size: int = 10, created: float = 1.0) -> NewEntry:
    return NewEntry(key=key, manifest_json=f'{{"k":"{key}"}}'.encode(), namespace=namespace,
                    model=model, env_digest=env, hw_digest=hw, digests=digests, size=size,
                    created_at=created)


# -- EntryStore -------------------------------------------------------------------------
def test_entry_store_put_get_list_delete(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        stored, created = await ix.put(entry("k1", digests=("a", "b"), size=30), Precondition())
        assert created and stored.namespace == "ns" and stored.digests == ("a", "b")
        _, created = await ix.put(entry("k1", digests=("a",), size=20), Precondition())
        assert not created
        got = await ix.get("k1")
        assert got is not None and got.digests == ("a",) and got.size == 20
        assert got.manifest_json == b'{"k":"k1"}' and got.etag
        await ix.put(entry("k2", model="other", created=2.0), Precondition())
        await ix.put(replace(entry("k3", namespace="ns2", env="e2", created=3.0),
                             provenance='{"writer":"w"}'), Precondition())
        assert [e.key for e in await ix.list_entries(limit=10)] == ["k3", "k2", "k1"]
        # listings carry who wrote each entry (a writers policy filters on it)
        assert [e.provenance for e in await ix.list_entries(namespace="ns2", limit=1)] == \
            ['{"sequence":1,"writer":"w"}']
        assert [e.key for e in await ix.list_entries(namespace="ns", limit=10)] == ["k2", "k1"]
        assert [e.key for e in await ix.list_entries(model="m", limit=10)] == ["k3", "k1"]
        assert [e.key for e in await ix.list_entries(env_digest="e", hw_digest="h",
                                                     limit=1)] == ["k2"]
        assert await ix.usage("ns") == (2, 30) and await ix.usage() == (3, 40)
        assert [e.key for e in await ix.largest_entries(namespace=None, limit=1)] == ["k1"]
        assert await ix.delete("k1") and not await ix.delete("k1")
        assert await ix.get("k1") is None and await ix.usage("ns") == (1, 10)
        assert sorted(await ix.entry_digests()) == ["k2", "k3"]

    run(make_index, body)


def test_entry_store_numbers_versions_across_rewrites_deletes_and_re_creates(
        make_index: Callable[[], Index]):
    """Each version's provenance gets a sequence above every earlier one of its key (and
    at least the floor asked), kept when the entry goes: a re-created key counts on."""
    async def body(ix: Index) -> None:
        def written(floor: int = 0) -> NewEntry:
            return replace(entry("k"), provenance='{"writer":"w"}', sequence_floor=floor)

        def number(e: StoredEntry | None) -> int:
            assert e is not None
            return int(json.loads(e.provenance)["sequence"])

        stored, _ = await ix.put(written(), Precondition())
        assert number(stored) == 1 and number(await ix.get("k")) == 1
        assert number((await ix.put(written(), Precondition()))[0]) == 2
        assert await ix.delete("k")
        assert number((await ix.put(written(), Precondition()))[0]) == 3  # re-created
        assert number((await ix.put(written(floor=1000), Precondition()))[0]) == 1000
        assert number((await ix.put(written(floor=10), Precondition()))[0]) == 1001
        with pytest.raises(PreconditionFailed):
            await ix.put(written(), Precondition(if_none_match="*"))
        assert number(await ix.get("k")) == 1001  # a refused write changed nothing it shows
        assert number((await ix.put(written(), Precondition()))[0]) > 1001
        assert (await ix.put(entry("plain"), Precondition()))[0].provenance == ""

    run(make_index, body)


def test_entry_store_listings_filter_across_pages(make_index: Callable[[], Index]):
    """Listings read the newest entries page by page: a filter that drops most of a page
    (another tenant's entries, another env) still fills the limit from later pages, newest
    first, with whole entries; an entry deleted under a lookup's touch is never listed."""
    async def body(ix: Index) -> None:
        for i in range(450):
            await ix.put(entry(f"k{i:03d}", namespace="ns" if i % 3 == 0 else "other",
                               env="e" if i % 5 else "e2", created=float(i)), Precondition())
        await ix.delete("k447")
        await ix.get("k447")  # a touch of a deleted entry leaves nothing listable
        ours = [f"k{i:03d}" for i in range(449, -1, -1) if i % 3 == 0 and i != 447]
        got = await ix.list_entries(namespace="ns", env_digest="e", hw_digest="h", limit=120)
        assert [e.key for e in got] == [k for k in ours if int(k[1:]) % 5][:120]
        assert got[0].manifest_json == f'{{"k":"{got[0].key}"}}'.encode() and got[0].etag
        assert got[0].digests == ("d1",) and got[0].size == 10
        by_model = await ix.list_entries(namespace="ns", model="m", limit=1000)
        assert [e.key for e in by_model] == ours
        assert await ix.list_entries(namespace="ns", env_digest="e9", hw_digest="h",
                                     limit=5) == []

    run(make_index, body)


def test_entry_store_preconditions_and_pins(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        stored, _ = await ix.put(entry("k"), Precondition(if_none_match="*"))
        with pytest.raises(PreconditionFailed):
            await ix.put(entry("k"), Precondition(if_none_match="*"))
        with pytest.raises(PreconditionFailed):
            await ix.put(entry("k"), Precondition(if_match='"nope"'))
        await ix.put(entry("k", size=5), Precondition(if_match=stored.etag))
        await ix.put(entry("old", created=0.5), Precondition())
        assert await ix.set_pinned("k", True) and not await ix.set_pinned("missing", True)
        assert [e.key for e in await ix.lru_entries(10)] == ["old"]
        await ix.put(entry("k", size=6), Precondition())
        assert (await ix.get("k", touch=False)).pinned  # type: ignore[union-attr]

    run(make_index, body)


def test_entry_store_lru_follows_access(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        for key in ("a", "b", "c"):
            await ix.put(entry(key), Precondition())
            await asyncio.sleep(0.01)
        await ix.get("a")
        assert [e.key for e in await ix.lru_entries(10)] == ["b", "c", "a"]
        assert [e.key for e in await ix.lru_entries(10, namespace="other")] == []

    run(make_index, body)


def test_entry_store_lru_pages_and_batch_eviction(make_index: Callable[[], Index]):
    """GC reads LRU entries page by page and evicts in batches; a pinned entry never goes."""
    async def body(ix: Index) -> None:
        keys = [f"k{i:02d}" for i in range(7)]
        for key in keys:
            await ix.put(entry(key), Precondition())
            await asyncio.sleep(0.005)
        await ix.set_pinned("k03", True)
        unpinned = [k for k in keys if k != "k03"]
        pages, last = [], None
        for _ in range(4):
            page = await ix.lru_entries(2, after=last)
            pages.append([e.key for e in page])
            last = page[-1] if page else last
        assert pages == [unpinned[0:2], unpinned[2:4], unpinned[4:6], []]
        assert await ix.delete_unpinned(["k00", "k03", "k05", "missing"]) == 2
        assert set(await ix.entry_digests()) == set(keys) - {"k00", "k05"}
        # every secondary index forgets them: listings, LRU, usage, blob references
        left = sorted(set(keys) - {"k00", "k05"})
        assert sorted(e.key for e in await ix.list_entries(model="m", limit=50)) == left
        assert sorted(e.key for e in await ix.lru_entries(50)) == sorted(set(left) - {"k03"})
        assert await ix.usage("ns") == (5, 50) and await ix.usage() == (5, 50)
        assert await ix.reference_counts(["d1"]) == {"d1": 5}
        assert not await ix.delete("k03", unless_pinned=True) and await ix.delete("k03")

    run(make_index, body)


def test_entry_store_batch_eviction_spans_batches(make_index: Callable[[], Index]):
    """A GC evicts thousands at once: more keys than one statement or script takes."""
    async def body(ix: Index) -> None:
        keys = [f"b{i:04d}" for i in range(1100)]
        for key in keys:
            await ix.put(entry(key, digests=(f"d-{key}",), size=1), Precondition())
        await ix.set_pinned("b0700", True)
        assert await ix.delete_unpinned(keys[:1050]) == 1049
        assert sorted(await ix.entry_digests()) == ["b0700", *keys[1050:]]
        assert await ix.usage() == (51, 51)
        counts = await ix.reference_counts([f"d-{k}" for k in keys])
        assert sum(counts.values()) == 51 and counts["d-b0700"] == 1

    run(make_index, body)


# -- BlobLedger -------------------------------------------------------------------------
def test_blob_ledger(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        assert await ix.record_blob("d1", 100, "ns")
        assert not await ix.record_blob("d1", 100, "ns")
        assert await ix.record_blob("d1", 100, "ns2")  # new to that namespace
        await ix.record_blob("d2", 50, "ns")
        assert await ix.stored_bytes() == 150
        assert await ix.pending_bytes("ns") == 150
        await ix.put(entry("k", digests=("d1",)), Precondition())
        assert await ix.pending_bytes("ns") == 50
        # only a namespace's own entries name its uploads: ns2 still holds d1 as pending,
        # so its quota cannot tell it that another namespace wrote an entry naming them
        assert await ix.pending_bytes("ns2") == 100
        assert await ix.referenced(["d1", "d2"]) == {"d1"}
        assert await ix.owns_blob("ns2", "d1") and not await ix.owns_blob("ns2", "d2")
        before = (await ix.blob_record("d2")).touched_at  # type: ignore[union-attr]
        await asyncio.sleep(0.01)
        await ix.touch_blobs(["d2"])
        assert (await ix.blob_record("d2")).touched_at > before  # type: ignore[union-attr]
        await ix.forget_blob("d2")
        assert await ix.blob_record("d2") is None and await ix.stored_bytes() == 100
        assert not await ix.owns_blob("ns", "d2")
        assert await ix.recorded_digests() == {"d1"}

    run(make_index, body)


def test_fsck_reads_cover_every_page(make_index: Callable[[], Index]):
    """What fsck compares with the blob store: every entry and its digests (one naming
    none too), every recorded blob, across more than one page of every backend's reads."""
    async def body(ix: Index) -> None:
        expected: dict[str, tuple[str, ...]] = {}
        for i in range(1203):
            digests = (f"a{i:04}", f"shared{i % 7}") if i % 100 else ()
            await ix.put(entry(f"k{i:04}", digests=digests, created=float(i)), Precondition())
            expected[f"k{i:04}"] = digests
            await ix.record_blob(f"a{i:04}", 10, "ns")
        await ix.delete("k0042")
        del expected["k0042"]
        assert await ix.get("k0042", touch=True) is None  # a touch of a gone entry counts not
        assert {k: tuple(sorted(d)) for k, d in (await ix.entry_digests()).items()} == {
            k: tuple(sorted(d)) for k, d in expected.items()}
        assert await ix.recorded_digests() == {f"a{i:04}" for i in range(1203)}

    run(make_index, body)


def test_blob_ledger_batches_for_gc(make_index: Callable[[], Index]):
    """What a GC plan reads: unreferenced blobs, reference counts and records by digest."""
    async def body(ix: Index) -> None:
        digests = [f"d{i:04d}" for i in range(1200)]  # more than one page of every batch
        for d in digests:
            await ix.record_blob(d, 10, "ns")
        await ix.put(entry("a", digests=("d0001", "d0002")), Precondition())
        await ix.put(entry("b", digests=("d0002",)), Precondition())
        idle = await ix.unreferenced_blobs()
        assert sorted(b.digest for b in idle) == sorted(set(digests) - {"d0001", "d0002"})
        assert all(b.size == 10 and b.touched_at > 0 for b in idle)
        counts = await ix.reference_counts(["d0001", "d0002", "d0003", "nope"])
        assert counts == {"d0001": 1, "d0002": 2, "d0003": 0, "nope": 0}
        records = await ix.blob_records_of(digests + ["nope"])
        assert set(records) == set(digests) and records["d0007"].size == 10
        await ix.forget_blobs(digests[600:])
        assert await ix.stored_bytes() == 6000
        assert len(await ix.blob_records_of(digests)) == 600
        assert not await ix.owns_blob("ns", digests[700])
        # an entry's blobs are unreferenced again once it goes (and no other names them),
        # and a blob recorded after the entry naming it (as fsck records one) is named
        assert await ix.delete("a")
        idle = {b.digest for b in await ix.unreferenced_blobs()}
        assert "d0001" in idle and "d0002" not in idle
        await ix.put(entry("c", digests=("late",)), Precondition())
        await ix.record_blob("late", 10, "ns")
        assert "late" not in {b.digest for b in await ix.unreferenced_blobs()}
        assert await ix.delete_unpinned(["b", "c"]) == 2
        idle = {b.digest for b in await ix.unreferenced_blobs()}
        assert {"d0002", "late"} <= idle and len(idle) == 601

    run(make_index, body)


def test_eviction_facts_count_entries_holds_and_sizes(make_index: Callable[[], Index]):
    """What a GC plan learns of each blob the entries it evicts name, in one read: the
    entries naming it, one more while a live job resolution holds it, and its size (None
    unrecorded); more digests than one batch."""
    async def body(ix: Index) -> None:
        now = time.time()
        digests = [f"e{i:04d}" for i in range(450)]
        for i, d in enumerate(digests):
            await ix.record_blob(d, 10 + i, "ns")
        await ix.put(entry("a", digests=("e0001", "e0002")), Precondition())
        await ix.put(entry("b", digests=("e0002", "unrecorded")), Precondition())
        held = await _stored(ix, "c", digests=("e0002", "e0003"))
        assert (await ix.resolve("ns", "job", 0, "c", held, 600, now)).hit
        assert await ix.delete("c")  # its blobs stay held by the job's resolution
        asked = [*digests, "unrecorded", "nope"]
        facts = await ix.eviction_facts(asked, now + 1)
        assert set(facts) == set(asked)
        assert facts["e0001"] == (1, 11) and facts["e0002"] == (3, 12)
        assert facts["e0003"] == (1, 13) and facts["e0449"] == (0, 459)
        assert facts["unrecorded"] == (1, None) and facts["nope"] == (0, None)
        later = await ix.eviction_facts(["e0002", "e0003"], now + 10**6)  # the hold expired
        assert later == {"e0002": (2, 12), "e0003": (0, 13)}

    run(make_index, body)


def test_redis_gc_reads_only_blobs_that_may_be_unreferenced(redis_service: LocalRedis):
    """Redis keeps the blobs that may have lost their last reference (`unref`): a plan reads
    those, not every blob, and what it finds named again leaves the set. A store written
    before the set existed is seeded from every blob once."""
    from megacache_server.store.index.redis import RedisIndex

    ix = RedisIndex(f"redis://127.0.0.1:{redis_service.port}/0", prefix=f"unref{next(_n)}:")

    async def body() -> None:
        for d in ("a1", "a2", "orphan"):
            await ix.record_blob(d, 10, "ns")
        await ix.put(entry("a", digests=("a1", "a2")), Precondition())
        candidates = ix.keys.unref()
        assert await ix.r.smembers(candidates) == {b"orphan"}  # the put named a1 and a2
        await ix.put(entry("b", digests=("a2",)), Precondition())
        assert await ix.delete("a")
        assert await ix.r.smembers(candidates) == {b"orphan", b"a1", b"a2"}
        assert [b.digest for b in await ix.unreferenced_blobs()] == ["a1", "orphan"]
        assert await ix.r.smembers(candidates) == {b"orphan", b"a1"}  # a2: named by b
        assert await ix.delete_unpinned(["b"]) == 1
        assert [b.digest for b in await ix.unreferenced_blobs()] == ["a1", "a2", "orphan"]
        await ix.forget_blobs(["a1", "a2"])
        assert await ix.r.smembers(candidates) == {b"orphan"}
        # a store from before the set: every blob is a candidate until a plan has looked
        await ix.r.delete(candidates, ix.keys.unref_ready())
        await ix.put(entry("c", digests=("c1",)), Precondition())
        await ix.r.hset(ix.keys.blobs(), "c1", 10)  # recorded the old way, named by c
        await ix.r.srem(candidates, "c1", "orphan")
        assert [b.digest for b in await ix.unreferenced_blobs()] == ["orphan"]
        assert await ix.r.smembers(candidates) == {b"orphan"}
        assert await ix.r.exists(ix.keys.unref_ready())

    run(lambda: ix, lambda _: body())


# -- QuotaStore -------------------------------------------------------------------------
def test_quota_store_holds_pending_bytes_until_released_or_lapsed(
        make_index: Callable[[], Index]):
    from megacache_server.store.index.base import PendingHold

    async def body(ix: Index) -> None:
        await ix.record_blob("d1", 100, "ns")  # pending: 100 of a cap of 200
        assert await ix.hold_pending("ns", "h1", 50, 200, 60, 1000.0) == \
            PendingHold(True, 100, 0)
        assert await ix.hold_pending("ns", "h2", 60, 200, 60, 1000.0) == \
            PendingHold(False, 100, 50)
        assert (await ix.hold_pending("other", "h2", 60, 200, 60, 1000.0)).granted
        assert (await ix.hold_pending("ns", "h1", 500, 200, 60, 1030.0)).granted  # renewed
        await ix.release_pending("ns", "h1")
        await ix.release_pending("ns", "gone")  # nothing to release: nothing happens
        assert (await ix.hold_pending("ns", "h2", 60, 200, 60, 1031.0)).granted
        assert not (await ix.hold_pending("ns", "h3", 60, 200, 60, 1090.0)).granted
        assert (await ix.hold_pending("ns", "h3", 60, 200, 60, 1092.0)).granted  # h2 lapsed
        await ix.put(entry("k", digests=("d1",)), Precondition())  # named: no longer pending
        assert (await ix.hold_pending("ns", "h4", 140, 200, 60, 1093.0)).granted

    run(make_index, body)


def test_quota_store_holds_never_pass_together_on_the_same_room(
        make_index: Callable[[], Index]):
    """Forty holds at once from two connections (two processes' worth), each 30 of a cap
    of 200: exactly six pass, however they interleave, also while uploads are recorded."""
    async def body(first: Index) -> None:
        second = make_index()
        await second.open()
        try:
            async def hold(i: int) -> bool:
                ix = (first, second)[i % 2]
                if i % 7 == 0:  # an upload recorded meanwhile (of no size: room unchanged)
                    await ix.record_blob(f"z{i}", 0, "ns")
                return (await ix.hold_pending("ns", f"h{i}", 30, 200, 60, 1000.0)).granted

            granted = await asyncio.gather(*(hold(i) for i in range(40)))
            assert sum(granted) == 6, granted
        finally:
            await second.close()

    run(make_index, body)


# -- TokenStore -------------------------------------------------------------------------
def test_token_store(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        record = TokenRecord("id1", "ci", "hash", ("read", "write"), "ns", time.time())
        await ix.put_token(record)
        assert await ix.get_token("id1") == record
        assert [t.token_id for t in await ix.list_tokens()] == ["id1"]
        assert await ix.revoke_token("id1") and not await ix.revoke_token("nope")
        assert (await ix.get_token("id1")).revoked  # type: ignore[union-attr]

    run(make_index, body)


# -- EventLog ---------------------------------------------------------------------------
def _event(model: str, outcome: str = "hit", **fields: object) -> Event:
    body = {"key": "a" * 64, "model": model, "outcome": outcome, "compile_s": 1.0,
            "cold_compile_s": 10.0, "saved_s": 9.0 if outcome == "hit" else 0.0, **fields}
    return parse_json(Event, json.dumps(body))


def test_event_log_rollups(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        for _ in range(3):
            await ix.add_event("ns", _event("m", bytes_down=2**40))
        await ix.add_event("ns", _event("m", "miss", reason="no entry"))
        await ix.add_event("ns2", _event("x", "miss", reason="other team"))
        old = datetime.now(timezone.utc) - timedelta(days=3)
        await ix.add_event("ns", _event("m", created_at=old.isoformat()))
        [m] = await ix.stats(namespace="ns")
        assert (m.runs, m.outcomes["hit"], m.outcomes["miss"]) == (5, 4, 1)
        assert m.saved_s == 36.0 and m.bytes_down == 3 * 2**40
        [recent] = await ix.stats(namespace="ns", since=time.time() - 3600)
        assert recent.runs == 4  # the event from three days ago is outside the window
        assert {s.namespace for s in await ix.stats(namespace=None)} == {"ns", "ns2"}
        slots = await ix.timeline(namespace="ns", since=time.time() - 4 * 86400)
        assert sum(s.runs for s in slots) == 5 and len(slots) == 2
        [miss] = await ix.top_misses(namespace="ns", since=0, limit=10)
        assert (miss.model, miss.reason, miss.count) == ("m", "no entry", 1)
        await ix.prune_events(raw_before=time.time(), rollups_before=time.time() - 86400)
        [total] = await ix.stats(namespace="ns")
        assert total.runs == 5  # totals never go down

    run(make_index, body)


def test_event_log_long_windows_sum_days_and_hours_alike(make_index: Callable[[], Index]):
    """A window of days reads daily rollups for whole days and hourly ones for the ends:
    every event counts once, in the same place as with hourly resolution throughout."""
    async def body(ix: Index) -> None:
        from megacache_server.store.index.redis import RedisIndex

        if isinstance(ix, RedisIndex):  # a store that wrote daily rollups from its start
            await ix.r.set(ix.keys.daily_from(), 0)
        now = datetime.now(timezone.utc)
        ages_h = [0, 5, 30, 49, 50, 75, 140, 200]
        for h in ages_h:
            when = (now - timedelta(hours=h)).isoformat()
            await ix.add_event("ns", _event("m", created_at=when))
            await ix.add_event("ns", _event("m", "miss", reason="cold", created_at=when))
        for days in (1, 3, 6, 10):
            since = time.time() - days * 86400
            expected = 2 * sum(1 for h in ages_h if h < days * 24 - 1)  # whole hours only
            [m] = await ix.stats(namespace="ns", since=since)
            assert expected <= m.runs <= expected + 2, (days, m.runs)
            hourly = await ix.timeline(namespace="ns", since=since)
            daily = await ix.timeline(namespace="ns", since=since, daily=True)
            assert sum(s.runs for s in hourly) == sum(s.runs for s in daily) == m.runs
            assert sum(s.warm for s in daily) == m.runs // 2
            [miss] = await ix.top_misses(namespace="ns", since=since, limit=10)
            assert miss.count == m.runs // 2
        days_slots = [s.start for s in await ix.timeline(namespace="ns", daily=True,
                                                          since=time.time() - 10 * 86400)]
        assert len(days_slots) == len(set(days_slots))
        assert all(start % 3600 == 0 for start in days_slots)

    run(make_index, body)


def test_event_log_bounds_models_and_reasons_a_tenant_can_invent(
        make_index: Callable[[], Index], monkeypatch: pytest.MonkeyPatch):
    """Model names and miss reasons are whatever a client sends: past a bound per namespace
    (per period for reasons) they count under one "other" row each. Nothing is lost from
    the sums, another namespace keeps its own bound, and names already counted stay."""
    from megacache_server.store.index import rollups

    monkeypatch.setattr(rollups, "MAX_MODELS", 3)
    monkeypatch.setattr(rollups, "MAX_REASONS", 2)

    async def body(ix: Index) -> None:
        for i in range(6):  # six invented models, each with an invented reason
            await ix.add_event("ns", _event(f"m{i}", "miss", reason=f"r{i}"))
        await ix.add_event("ns", _event("m0", "miss", reason="r0"))  # known: still its own
        await ix.add_event("other", _event("x", "miss", reason="mine"))
        models = {m.model: m.runs for m in await ix.stats(namespace="ns")}
        assert models == {"m0": 2, "m1": 1, "m2": 1, rollups.OTHER_MODELS: 3}
        windowed = await ix.stats(namespace="ns", since=time.time() - 3600)
        assert {m.model: m.runs for m in windowed} == models
        misses = {(m.model, m.reason): m.count
                  for m in await ix.top_misses(namespace="ns", since=0, limit=10)}
        assert misses == {("m0", "r0"): 2, ("m1", "r1"): 1,
                          ("m2", rollups.OTHER_REASONS): 1,
                          (rollups.OTHER_MODELS, rollups.OTHER_REASONS): 3}
        assert sum(misses.values()) == 7
        [mine] = await ix.top_misses(namespace="other", since=0, limit=10)
        assert (mine.model, mine.reason) == ("x", "mine")

    run(make_index, body)


def test_redis_rollup_sums_are_reused_until_a_period_changes(redis_service: LocalRedis):
    """A week's stats and misses on Redis add up ~31 periods; a process keeps the decoded
    ones and the sum of the settled ones, and reads again only what an event changed: the
    current period on every new event, an old one when a late event lands in it. Every
    answer equals that of a process with nothing cached."""
    from megacache_server.store.index.redis import RedisIndex

    url, prefix = f"redis://127.0.0.1:{redis_service.port}/0", f"sums{next(_n)}:"
    ix = RedisIndex(url, prefix=prefix)
    now = datetime.now(timezone.utc)

    async def answers(index: RedisIndex) -> tuple[object, object]:
        since = time.time() - 7 * 86400
        return (await index.stats(namespace=None, since=since),
                await index.top_misses(namespace="ns", since=since, limit=10))

    async def uncached() -> tuple[object, object]:
        fresh = RedisIndex(url, prefix=prefix)
        await fresh.open()
        try:
            return await answers(fresh)
        finally:
            await fresh.close()

    async def add(hours_ago: float, outcome: str = "miss") -> None:
        when = (now - timedelta(hours=hours_ago)).isoformat()
        await ix.add_event("ns", _event("m", outcome, reason=f"r{int(hours_ago)}", created_at=when))

    async def body() -> None:
        await ix.r.set(ix.keys.daily_from(), 0)
        for h in (1, 30, 50, 100):
            await add(h)
        first = await answers(ix)
        assert first == await uncached()
        ix._sums.fetched.clear()
        assert await answers(ix) == first
        today = int(time.time() // 86400 * 86400)  # the event an hour ago may be in it
        assert all(key.endswith(f":{today}") for key in ix._sums.fetched)
        await add(0.0, "hit")  # now: the live periods change
        await add(100.0)  # late: a settled day changes
        [m], misses = await answers(ix)
        assert m.runs == 6 and m.outcomes["hit"] == 1
        assert {(x.reason, x.count) for x in misses} == {  # type: ignore[attr-defined]
            ("r1", 1), ("r30", 1), ("r50", 1), ("r100", 2)}
        assert ([m], misses) == await uncached()
        # a hash from before generations were kept is never served from the cache
        await ix.r.delete(*[k for k in await ix.r.keys(f"{prefix}gen*")])
        await ix.add_event("ns", _event("m", created_at=(now - timedelta(hours=50)).isoformat()))
        await ix.r.delete(*[k for k in await ix.r.keys(f"{prefix}gen*")])
        [m], _ = await answers(ix)
        assert m.runs == 7

    run(lambda: ix, lambda _: body())


# -- LockStore --------------------------------------------------------------------------
def test_lock_store_is_shared_and_expires(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        other = make_index()
        await other.open()
        try:
            assert await ix.acquire_lock("gc", ttl_s=0.3)
            assert not await other.acquire_lock("gc", ttl_s=0.3)
            await other.release_lock("gc")  # not its lock: no effect
            assert not await other.acquire_lock("gc", ttl_s=0.3)
            await asyncio.sleep(0.35)
            assert await other.acquire_lock("gc", ttl_s=0.3)
        finally:
            await other.close()

    run(make_index, body)


# -- JobStore ---------------------------------------------------------------------------
async def _stored(ix: Index, key: str, **kwargs: object) -> StoredEntry:
    await ix.put(entry(key, **kwargs), Precondition())  # type: ignore[arg-type]
    got = await ix.get(key, touch=False)
    assert got is not None
    return got


def test_job_store_one_resolution_per_attempt(make_index: Callable[[], Index]):
    """Every rank of an attempt gets the first rank's answer, whatever it offers; a new
    attempt, another job or another namespace resolves afresh; blobs are held meanwhile."""
    async def body(ix: Index) -> None:
        other = make_index()  # another process or replica on the same index
        await other.open()
        try:
            now = time.time()
            v1 = await _stored(ix, "k", digests=("a", "b"))
            first = await ix.resolve("ns", "job-1", 0, "k", v1, 600, now)
            assert first.hit and first.manifest_json == v1.manifest_json
            assert first.etag == v1.etag and first.entry_namespace == "ns"
            # Redis's Lua writes numbers with 14 significant digits: a tenth of a
            # millisecond of an epoch time may round away
            assert first.digests == ("a", "b") and first.expires_at >= now + 600 - 1e-3
            v2 = replace(v1, manifest_json=b'{"k":"v2"}', etag='"v2"', digests=("c",))
            for i, ix_ in enumerate([ix, other] * 4):
                again = await ix_.resolve("ns", "job-1", 0, "k", v2 if i % 2 else None,
                                          600, now + i)
                assert (again.manifest_json, again.etag, again.digests, again.resolved_at) \
                    == (first.manifest_json, first.etag, first.digests, first.resolved_at)
            retry = await other.resolve("ns", "job-1", 1, "k", v2, 600, now + 10)
            assert retry.manifest_json == b'{"k":"v2"}' and retry.attempt == 1
            miss = await ix.resolve("ns", "job-2", 0, "k", None, 600, now)
            assert not miss.hit and miss.digests == () and miss.etag == ""
            assert not (await other.resolve("ns", "job-2", 0, "k", v2, 600, now + 1)).hit
            # another tenant's job of the same name is another record
            assert (await ix.resolve("ns2", "job-1", 0, "k", None, 600, now)).hit is False
            assert (await ix.resolve("ns", "job-1", 0, "k", None, 600, now)).hit
            assert await ix.held_blobs(["a", "b", "c", "z"], now + 1) == {"a", "b", "c"}
            assert await other.held_blobs(["a", "b", "c"], now + 10**6) == set()
        finally:
            await other.close()

    run(make_index, body)


def test_job_store_expiry_renewal_and_bounds(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        now = time.time()
        v1 = await _stored(ix, "k", digests=("a",))
        v2 = replace(v1, manifest_json=b'{"k":"v2"}', digests=("b",))
        first = await ix.resolve("ns", "j", 0, "k", v1, 100, now)
        assert first.expires_at == pytest.approx(now + 100)
        # asked at 60 s: renewed (to at least half a ttl ahead), so still live at 150 s
        renewed = await ix.resolve("ns", "j", 0, "k", v2, 100, now + 60)
        assert renewed.manifest_json == v1.manifest_json and renewed.expires_at >= now + 110 - 1e-3
        assert (await ix.resolve("ns", "j", 0, "k", v2, 100, now + 105)).manifest_json \
            == v1.manifest_json
        assert await ix.held_blobs(["a"], now + 105) == {"a"}
        # a shorter ttl never shortens a live resolution
        short = await ix.resolve("ns", "j", 0, "k", v2, 1, now + 106)
        assert short.manifest_json == v1.manifest_json and short.expires_at >= now + 155
        # nobody asked for longer than its life: expired, resolved afresh
        later = now + 10_000
        fresh = await ix.resolve("ns", "j", 0, "k", v2, 100, later)
        assert fresh.manifest_json == b'{"k":"v2"}' and fresh.resolved_at == pytest.approx(later)
        assert await ix.held_blobs(["a", "b"], later + 1) == {"b"}
        # every number is bounded, whatever the caller asks
        huge = await ix.resolve("ns", "j2", 0, "k", v1, 10.0**12, now)
        assert huge.expires_at <= now + MAX_RESOLUTION_TTL_S + 1
        assert (await ix.resolve("ns", "j3", 0, "k", v1, float("nan"), now)).expires_at \
            <= now + 2
        await ix.prune_jobs(later + 10**6)
        assert await ix.held_blobs(["a", "b"], later + 1) == set()

    run(make_index, body)


def test_job_records_are_capped_per_namespace(make_index: Callable[[], Index]):
    """Resolutions and claims together count on their namespace's cap while they live: a
    new one past it is refused with nothing written; renewing a live one, another
    namespace, and room made by expiry or release go on."""
    from megacache_server.errors import InsufficientStorage

    async def body(ix: Index) -> None:
        now = 1000.0
        for i in range(2):
            await ix.resolve("ns", f"j{i}", 0, "k", None, 60, now, max_records=3)
        assert (await ix.claim("ns", "k", "h1", 30, now, max_records=3)).granted
        with pytest.raises(InsufficientStorage) as refused:
            await ix.resolve("ns", "j9", 0, "k", None, 60, now, max_records=3)
        assert refused.value.code == "job_records_quota"
        with pytest.raises(InsufficientStorage):
            await ix.claim("ns", "k2", "h1", 30, now, max_records=3)
        assert (await ix.resolve("ns", "j0", 0, "k", None, 60, now + 1,
                                 max_records=3)).resolved_at == now  # renewed, not new
        assert (await ix.claim("ns", "k", "h1", 30, now + 1, max_records=3)).granted
        await ix.resolve("other", "j9", 0, "k", None, 60, now, max_records=3)
        assert await ix.release("ns", "k", "h1", now + 2)
        await ix.resolve("ns", "j9", 0, "k", None, 60, now + 2, max_records=3)  # released
        with pytest.raises(InsufficientStorage):
            await ix.claim("ns", "k2", "h1", 30, now + 2, max_records=3)
        assert (await ix.claim("ns", "k2", "h1", 30, now + 200, max_records=3)).granted
        await ix.resolve("ns", "j8", 0, "k", None, 60, now + 200)  # no cap given: no cap

    run(make_index, body)


# -- RateStore --------------------------------------------------------------------------
def test_rate_store_buckets_are_shared_and_refill(make_index: Callable[[], Index]):
    """Twenty takes at once from two connections of a bucket of 5: exactly 5 pass; it
    refills at its rate; buckets are apart."""
    async def body(first: Index) -> None:
        second = make_index()
        await second.open()
        try:
            waits = await asyncio.gather(*((first, second)[i % 2].take("b", 2.0, 5.0, 100.0)
                                           for i in range(20)))
            assert sum(w == 0.0 for w in waits) == 5, waits
            assert min(w for w in waits if w) == pytest.approx(0.5)
            assert await first.take("b", 2.0, 5.0, 101.0) == 0.0  # 2 came back in a second
            assert await second.take("b", 2.0, 5.0, 101.0) == 0.0
            assert await first.take("b", 2.0, 5.0, 101.0) > 0
            assert await first.take("other", 2.0, 5.0, 101.0) == 0.0
        finally:
            await second.close()

    run(make_index, body)


# -- ClaimStore -------------------------------------------------------------------------
def test_claim_store_one_claimant_wins(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        indexes = [make_index() for _ in range(4)]
        for other in indexes:
            await other.open()
        try:
            now = time.time()
            got = await asyncio.gather(*(indexes[i % 4].claim("ns", "k", f"node-{i}", 60, now)
                                         for i in range(8)))
            winners = [c for c in got if c.granted]
            assert len(winners) == 1
            winner = winners[0].holder
            assert {c.holder for c in got} == {winner}  # the losers are told who holds it
            assert all(c.expires_at == pytest.approx(now + 60) for c in got)
            # the holder renews; a release by anyone else is refused and changes nothing
            assert (await ix.claim("ns", "k", winner, 60, now + 30)).expires_at \
                == pytest.approx(now + 90)
            assert not await ix.release("ns", "k", "node-x", now + 31)
            assert not (await ix.claim("ns", "k", "node-x", 60, now + 31)).granted
            # other namespaces and keys are other claims
            assert (await ix.claim("ns2", "k", "node-x", 60, now)).granted
            assert (await ix.claim("ns", "k2", "node-x", 60, now)).granted
            # the holder releases: the next claimant gets it at once
            assert await ix.release("ns", "k", winner, now + 32)
            assert await ix.release("ns", "k", winner, now + 32)  # idempotent
            assert (await ix.claim("ns", "k", "node-y", 60, now + 33)).granted
        finally:
            for other in indexes:
                await other.close()

    run(make_index, body)


def test_claim_store_expired_lease_is_taken_over(make_index: Callable[[], Index]):
    async def body(ix: Index) -> None:
        now = time.time()
        assert (await ix.claim("ns", "k", "dead", 10, now)).granted
        held = await ix.claim("ns", "k", "next", 10, now + 9)
        assert not held.granted and held.holder == "dead"
        taken = await ix.claim("ns", "k", "next", 10, now + 11)
        assert taken.granted and taken.holder == "next"
        assert not await ix.release("ns", "k", "dead", now + 12)  # lost it: refused
        huge = await ix.claim("ns", "k2", "h", 10.0**9, now)
        assert huge.expires_at <= now + MAX_CLAIM_LEASE_S + 1
        await ix.prune_jobs(now + 10**6)
        assert (await ix.claim("ns", "k", "third", 10, now + 10**6)).granted

    run(make_index, body)


# -- TrustStore -------------------------------------------------------------------------
def test_trust_store_keeps_quarantine_records_whole(make_index: Callable[[], Index]):
    """A record reads back as written, its reporter's namespace included (what decides who
    may read the reporter and the detail), newest first, those touching a namespace only."""
    from megacache_server.store.index.base import QuarantineRecord

    async def body(ix: Index) -> None:
        first = QuarantineRecord("d" * 64, "digest", "hashes to x", "ci", 1.0, 10,
                                 ("a", "b"), ("a/k1",), "a")
        second = QuarantineRecord("", "load", "3 reports", "trainer", 2.0, 20, ("b",),
                                  ("b/k2",), "b")
        await ix.add_quarantine(first)
        await ix.add_quarantine(second)
        assert await ix.quarantines(namespace=None, limit=10) == [second, first]
        assert await ix.quarantines(namespace="a", limit=10) == [first]
        assert await ix.quarantine_counts() == {"digest": 1, "load": 1}
        assert await ix.quarantined(["d" * 64, "e" * 64]) == {"d" * 64}

    run(make_index, body)
