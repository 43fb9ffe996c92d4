"""What the service keeps besides blob bytes, as small storage protocols, each declared and
documented here and nowhere else: a backend's modules say how they store, not what.

`Index` is every protocol at once; a backend (`sqlite/`, `redis/`) implements each protocol
in a module of its own and `Index` as the class made of them. Only the cache service
(`megacache_server.service`) calls these: routes never do.
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from megacache_client.wire.events import OUTCOMES, REPLAYS, Event
from megacache_client.wire.progress import ProgressRecord
from megacache_server.errors import InsufficientStorage, PreconditionFailed
from megacache_server.store.index import rollups
from megacache_server.store.index.progress import Fold, JobProgress


@dataclass(frozen=True)
class EntryInfo:
    """An entry without its manifest bytes: what eviction, quotas and dashboards need."""

    key: str
    namespace: str
    model: str
    digests: tuple[str, ...]
    size: int  # stored bytes of the blobs it names
    created_at: float
    updated_at: float
    last_access: float
    pinned: bool


@dataclass(frozen=True)
class StoredEntry(EntryInfo):
    manifest_json: bytes = b""
    etag: str = ""
    provenance: str = ""
    """Who wrote this version (`service.provenance`, canonical JSON); "" for entries written
    before provenance was recorded."""


@dataclass(frozen=True)
class NewEntry:
    """An entry to write: the validated manifest bytes and the columns derived from it."""

    key: str
    manifest_json: bytes
    namespace: str
    model: str
    env_digest: str
    hw_digest: str
    digests: tuple[str, ...]
    size: int
    created_at: float
    provenance: str = ""
    """Who wrote it (canonical JSON); the backend adds the version's `sequence` to it."""
    sequence_floor: int = 0
    """The lowest version number this write may get (the server's clock in ms): a key's
    versions count up from where the clock stands even once every record of it is gone."""


def sequenced(provenance: str, sequence: int) -> str:
    """`provenance` (canonical JSON, as `service.provenance` writes it) with `sequence`
    set: what an entry version is stored and served with ("" stays "")."""
    if not provenance:
        return ""
    return canonical(json.loads(provenance) | {"sequence": sequence})


def canonical(data: dict[str, Any]) -> str:
    """JSON as provenance is kept and signed: sorted keys, no spaces, ASCII."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class BlobRecord:
    """What the index knows of a committed blob; `touched_at` guards it from early GC."""

    digest: str
    size: int
    touched_at: float


@dataclass(frozen=True)
class TokenRecord:
    """A bearer token as stored: only its hash, never the token itself."""

    token_id: str
    name: str
    token_hash: str
    scopes: tuple[str, ...]
    namespace: str
    created_at: float
    revoked: bool = False
    expires_at: float | None = None  # epoch seconds; None: never

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True)
class Precondition:
    """HTTP conditional-request headers for an entry write (RFC 9110 §13)."""

    if_match: str | None = None
    if_none_match: str | None = None


@dataclass
class ModelStats:
    namespace: str
    model: str
    runs: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    compile_s: float = 0.0
    saved_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    tts_s: float = 0.0
    tts_n: int = 0
    jobs: dict[str, float] = field(default_factory=lambda: dict.fromkeys(rollups.JOB_COUNTERS,
                                                                         0.0))
    """Job attempts, restarts and the job histograms (`rollups.JOB_COUNTERS`)."""
    replays: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLAYS, 0))
    """Runs by `Event.replay` (full, partial, rebuilt); runs that did not say count in none."""

    @property
    def attempts(self) -> int:
        return int(self.jobs["attempts"])

    @property
    def restarts(self) -> int:
        return int(self.jobs["restarts"])

    def buckets(self, histogram: str) -> list[float]:
        """A job histogram's bucket counts, not cumulative; the last is +Inf's."""
        return rollups.bucket_counts(self.jobs, histogram)

    def quantile(self, histogram: str, q: float) -> float | None:
        return rollups.quantile(self.buckets(histogram), q)

    @property
    def hit_rate(self) -> float:
        """Runs that started warm (exact or fallback) over all runs."""
        warm = self.outcomes["hit"] + self.outcomes["fallback"]
        return warm / self.runs if self.runs else 0.0

    @property
    def mean_tts_s(self) -> float | None:
        """Mean time from process start to the first compiled step, where clients said."""
        return self.tts_s / self.tts_n if self.tts_n else None

    def add(self, counters: dict[str, float]) -> None:
        self.runs += int(counters.get("runs", 0))
        for outcome in OUTCOMES:
            self.outcomes[outcome] += int(counters.get(outcome, 0))
        self.compile_s += counters.get("compile_s", 0.0)
        self.saved_s += counters.get("saved_s", 0.0)
        self.bytes_down += int(counters.get("bytes_down", 0))
        self.bytes_up += int(counters.get("bytes_up", 0))
        self.tts_s += counters.get("tts_s", 0.0)
        self.tts_n += int(counters.get("tts_n", 0))
        jobs = self.jobs
        for name in rollups.JOB_COUNTERS:
            jobs[name] += counters.get(name, 0.0)
        for replay in REPLAYS:
            self.replays[replay] += int(counters.get(rollups.replay_counter(replay), 0))


@dataclass(frozen=True)
class TimelineSlot:
    start: int
    runs: int
    warm: int
    saved_s: float
    tts_s: float
    tts_n: int


@dataclass(frozen=True)
class MissReason:
    model: str
    outcome: str
    reason: str
    count: int


@dataclass(frozen=True)
class AttemptRecord(rollups.AttemptState):
    """One job attempt as its ranks reported it: the slowest rank's time to start (attempt
    0) or recover, that rank's outcome, the most compile seconds of any rank (what the
    index keeps of it, `rollups.AttemptState`), and which attempt it is."""

    attempt: int


@dataclass(frozen=True)
class JobView:
    namespace: str
    job_id: str
    last_seen: float
    attempts: list[AttemptRecord]  # newest attempt first


MAX_VIEW_ATTEMPTS = 20
"""Attempts of one job a job view lists (the latest)."""


class EntryStore(ABC):
    """Fingerprint key -> manifest (the action cache), with what eviction, quotas and
    listings need already in columns (namespace, model, blob digests, size): nobody re-parses
    manifests to learn them."""

    @abstractmethod
    async def get(self, key: str, *, touch: bool = True) -> StoredEntry | None:
        """The entry for `key`; `touch` records the access for LRU eviction."""

    @abstractmethod
    async def touch(self, entry: StoredEntry) -> StoredEntry:
        """Record an access of `entry` for LRU eviction (the caller has checked that the
        reader may see it: a lookup from another namespace must not reorder eviction)."""

    @abstractmethod
    async def put(self, entry: NewEntry, condition: Precondition) -> tuple[StoredEntry, bool]:
        """Write an entry atomically with its precondition; returns (entry, created).

        The version gets its sequence number in the same atomic step: one above every
        number this key had before (across rewrites, deletes and re-creates, on every
        replica) and at least `entry.sequence_floor`, added to its provenance (`sequenced`)
        and kept for the key after the entry is gone. So the version that stands is always
        the highest-numbered one, and a client that has seen a number refuses an older
        version served later (a proxy replaying a superseded, validly signed manifest).
        Raises PreconditionFailed when the condition does not hold at write time.
        """

    @abstractmethod
    async def list_entries(self, *, namespace: str | None = None, model: str | None = None,
                           env_digest: str | None = None, hw_digest: str | None = None,
                           limit: int) -> list[StoredEntry]:
        """Entries matching every given filter, newest (by manifest created_at) first."""

    @abstractmethod
    async def entry_digests(self) -> dict[str, tuple[str, ...]]:
        """Every entry's key and the blobs it names: fsck's side of its check, and no more
        (at a million entries the rest of each entry is seconds of reading fsck discards)."""

    @abstractmethod
    async def largest_entries(self, *, namespace: str | None, limit: int) -> list[EntryInfo]:
        """The biggest entries by stored bytes."""

    @abstractmethod
    async def usage(self, namespace: str | None = None) -> tuple[int, int]:
        """(entries, bytes of their blobs) of a namespace, or of the whole store."""

    @abstractmethod
    async def delete(self, key: str, *, unless_pinned: bool = False) -> bool:
        """Remove an entry; True if it was there (and, with `unless_pinned`, not pinned)."""

    async def delete_unpinned(self, keys: list[str]) -> int:
        """Evict many entries, each only if it is still there and unpinned; how many went.
        Backends that can delete in batches override this."""
        return sum([await self.delete(key, unless_pinned=True) for key in keys])

    @abstractmethod
    async def set_pinned(self, key: str, pinned: bool) -> bool:
        """Pin (never evict) or unpin an entry; False if there is no such entry."""

    async def flush_access(self) -> None:  # noqa: B027 - optional hook
        """Write the access times a backend buffers, for a reader on another connection
        (the off-loop collector) to see the same LRU order."""

    @abstractmethod
    async def lru_entries(self, limit: int, *, namespace: str | None = None,
                          after: EntryInfo | None = None) -> list[EntryInfo]:
        """Unpinned entries, least recently accessed first, from the one after `after` (the
        last of the previous page): eviction candidates, read page by page."""


class BlobLedger(ABC):
    """Which blobs the CAS holds, their sizes, last touch and owning namespaces."""

    @abstractmethod
    async def record_blob(self, digest: str, size: int, namespace: str) -> bool:
        """Note a blob committed to the CAS for `namespace`; True if new to that namespace."""

    @abstractmethod
    async def stored_bytes(self) -> int:
        """Total size of recorded blobs: what the store budget is checked against."""

    @abstractmethod
    async def pending_bytes(self, namespace: str) -> int:
        """Bytes of blobs `namespace` uploaded that no entry of `namespace` names (yet).

        Another namespace's entries do not count: bytes a tenant uploads weigh the same on
        its quota whether or not some other tenant's entry names them, so the quota cannot
        tell it what others stored."""

    @abstractmethod
    async def recorded_digests(self) -> set[str]:
        """The digest of every blob the index has recorded (fsck compares them with the
        blob store), read in pages where the backend serves others meanwhile."""

    async def blob_record(self, digest: str) -> BlobRecord | None:
        """One blob's record, or None (backends with a faster point read override it)."""
        return (await self.blob_records_of([digest])).get(digest)

    @abstractmethod
    async def blob_records_of(self, digests: list[str]) -> dict[str, BlobRecord]:
        """The records of those of `digests` the index holds."""

    @abstractmethod
    async def unreferenced_blobs(self) -> list[BlobRecord]:
        """Every recorded blob that no entry names (GC's candidates), read in pages."""

    @abstractmethod
    async def reference_counts(self, digests: list[str]) -> dict[str, int]:
        """How many entries name each of `digests` (0 for none)."""

    async def referenced(self, digests: list[str]) -> set[str]:
        """Which of `digests` some entry names."""
        return {d for d, n in (await self.reference_counts(digests)).items() if n}

    @abstractmethod
    async def touch_blobs(self, digests: list[str]) -> None:
        """Mark blobs as just used (a manifest naming them is being written)."""

    @abstractmethod
    async def forget_blobs(self, digests: list[str]) -> None:
        """Drop blobs' records (and their owners) after the store deleted them."""

    async def forget_blob(self, digest: str) -> None:
        await self.forget_blobs([digest])

    @abstractmethod
    async def owns_blob(self, namespace: str, digest: str) -> bool:
        """Whether `namespace` may see this blob (the CAS dedupes bytes across namespaces)."""


@dataclass(frozen=True)
class PendingHold:
    """The answer to a hold on a namespace's pending quota, and what the quota stood at."""

    granted: bool
    pending: int  # bytes of blobs the namespace uploaded that none of its entries names
    held: int  # bytes the namespace's other live holds keep (uploads in flight)


class QuotaStore(ABC):
    """Holds on a namespace's pending quota, shared by every worker and replica: an upload
    holds its bytes while it streams, so N connections to N processes cannot each pass the
    quota. A hold lives until released or until its time runs out (a worker that crashes
    mid-upload holds nothing for long); the uploader renews it while bytes arrive."""

    @abstractmethod
    async def hold_pending(self, namespace: str, hold_id: str, size: int, cap: int,
                           ttl_s: float, now: float) -> PendingHold:
        """Hold `size` bytes of `namespace`'s pending quota under `hold_id` until
        `now + ttl_s`, if `pending_bytes(namespace)`, the bytes of the namespace's other
        live holds and `size` fit in `cap` (else nothing is held: granted False). A live
        hold of that id is renewed instead, whatever the cap. Atomic across processes and
        replicas (a transaction, a script): two holds decided at once never both pass on
        the same room. Holds past their time are dropped before deciding."""

    @abstractmethod
    async def release_pending(self, namespace: str, hold_id: str) -> None:
        """Drop a hold (nothing to do if it lapsed)."""


class TokenStore(ABC):
    """Bearer tokens, hashed."""

    @abstractmethod
    async def put_token(self, token: TokenRecord) -> None:
        """Store a new token record."""

    @abstractmethod
    async def get_token(self, token_id: str) -> TokenRecord | None:
        """A token record by id (revoked ones included)."""

    @abstractmethod
    async def list_tokens(self) -> list[TokenRecord]:
        """Every token record, oldest first."""

    @abstractmethod
    async def revoke_token(self, token_id: str) -> bool:
        """Revoke a token; False if there is no such token."""


class EventLog(ABC):
    """Client runs, folded into rollups as they arrive (running totals that never go down,
    hourly buckets, miss reasons), with raw events kept for a bounded time only; runs of a
    job are also folded per (job, attempt), each attempt counted once (its slowest rank)."""

    @abstractmethod
    async def add_event(self, namespace: str, event: Event) -> None:
        """Record one run: its raw event, and its counters in every rollup."""

    @abstractmethod
    async def stats(self, *, namespace: str | None, since: float | None = None
                    ) -> list[ModelStats]:
        """Per-(namespace, model) sums since `since` (hour resolution; None: all time)."""

    @abstractmethod
    async def timeline(self, *, namespace: str | None, since: float,
                       daily: bool = False) -> list[TimelineSlot]:
        """Hourly runs, warm starts, seconds saved and time to start since `since`."""

    @abstractmethod
    async def top_misses(self, *, namespace: str | None, since: float,
                         limit: int) -> list[MissReason]:
        """The most frequent reasons runs did not start warm."""

    @abstractmethod
    async def prune_events(self, *, raw_before: float, rollups_before: float) -> int:
        """Drop raw events and hourly rollups older than these times (totals stay), and
        job attempt records not reported since `raw_before` or beyond rollups.MAX_JOBS."""

    @abstractmethod
    async def recent_jobs(self, *, namespace: str | None, limit: int) -> list[JobView]:
        """The `limit` jobs that reported last, each with its latest attempts."""

    @abstractmethod
    async def job_view(self, namespace: str, job: str) -> JobView | None:
        """One job of `namespace` with its latest attempts; None if it never reported."""


class RateStore(ABC):
    """Token buckets shared by every worker and replica: a caller's rate limit holds
    however its requests are spread over processes (a bucket per process would let a
    caller with N connections spread over N processes take N times its rate)."""

    @abstractmethod
    async def take(self, bucket: str, rate: float, burst: float, now: float) -> float:
        """Take one unit from `bucket`, which fills at `rate` per second up to `burst` (and
        is full when first used): 0.0 when taken, else the seconds until one is there
        (nothing is taken). Atomic across processes; a bucket unused for long may be
        forgotten (it would be full again)."""


def refill(bucket: tuple[float, float] | None, rate: float, burst: float,
           now: float) -> tuple[float, float]:
    """A token bucket's (tokens, at), or None for a new one (full), refilled to `now` and
    one unit taken if there is one: (tokens left, 0.0), else (tokens, seconds until one is
    there). One rule for the backends that compute it themselves."""
    tokens, at = bucket if bucket is not None else (burst, now)
    tokens = min(burst, tokens + max(0.0, now - at) * rate)
    if tokens < 1:
        return tokens, (1 - tokens) / rate
    return tokens - 1, 0.0


class LockStore(ABC):
    """Named locks shared by every replica."""

    @abstractmethod
    async def acquire_lock(self, name: str, ttl_s: float) -> bool:
        """Take a named lock shared by every replica (True if taken); it expires after ttl."""

    @abstractmethod
    async def release_lock(self, name: str) -> None:
        """Release a lock this process took."""


def records_full(namespace: str, cap: int) -> InsufficientStorage:
    """The refusal of a resolution or claim that would pass its namespace's cap of live
    job records (`JobStore.resolve`, `ClaimStore.claim`), the same on every backend."""
    return InsufficientStorage(
        f"namespace {namespace!r} holds {cap} live job resolutions and publish claims, its "
        "limit: new ones are refused until some expire (MEGACACHE_NAMESPACE_JOB_RECORDS)",
        code="job_records_quota", limit=cap)


MAX_RESOLUTION_TTL_S = 24 * 3600.0
"""The longest a resolution lives without a rank asking again (a day)."""
MAX_CLAIM_LEASE_S = 15 * 60.0
"""The longest a publish claim lasts unrenewed: a claimant that dies blocks others this long."""


@dataclass(frozen=True)
class Resolution:
    """What one job attempt resolved a key to, fixed by its first rank: the entry as it was
    then (manifest bytes, ETag, the namespace that wrote it, its blobs), or a miss."""

    namespace: str  # the job's namespace (the caller's), not necessarily the entry's
    job: str
    attempt: int
    key: str
    manifest_json: bytes  # b"": a miss
    etag: str
    entry_namespace: str
    digests: tuple[str, ...]
    resolved_at: float
    expires_at: float

    @property
    def hit(self) -> bool:
        return bool(self.manifest_json)


@dataclass(frozen=True)
class Claim:
    """A publish claim as it stands after a claim call: `granted` when `holder` is the caller."""

    granted: bool
    holder: str
    expires_at: float


class JobStore(ABC):
    """One resolution of a fingerprint key per (namespace, job, attempt), fixed by the first
    rank that asks and held (with its blobs, against GC) while ranks keep asking."""

    @abstractmethod
    async def resolve(self, namespace: str, job: str, attempt: int, key: str,
                      candidate: StoredEntry | None, ttl_s: float, now: float, *,
                      max_records: int | None = None) -> Resolution:
        """The resolution of `key` for this job attempt: the live one if there is one (its
        life renewed to at least `now + ttl_s / 2`, never shortened), else `candidate` (an
        entry, or None for a miss) recorded atomically, alive until `now + ttl_s`. Every
        caller gets the same answer until it expires, across processes and replicas; while
        it lives, its blobs are held (`held_blobs`). `ttl_s` is clamped to
        MAX_RESOLUTION_TTL_S. A new record is refused (`records_full`, nothing written)
        when the namespace already holds `max_records` live resolutions and claims
        together: a record holds a manifest's bytes for up to a day, and a read token can
        make up job ids."""

    @abstractmethod
    async def held_blobs(self, digests: list[str], now: float) -> set[str]:
        """Which of `digests` a resolution alive at `now` names: GC never deletes them."""

    @abstractmethod
    async def prune_jobs(self, now: float) -> int:
        """Drop resolutions and claims expired before `now` (and the holds of their blobs);
        how many went. Backends whose records expire on their own may return 0."""


class ClaimStore(ABC):
    """Publish claims, a lease per (namespace, key): one uploader across a fleet."""

    @abstractmethod
    async def claim(self, namespace: str, key: str, holder: str, lease_s: float,
                    now: float, *, max_records: int | None = None) -> Claim:
        """Claim the publish of `key`: granted (until `now + lease_s`) when nobody holds a
        live claim or `holder` already does (a renewal); else the current holder and when
        its lease runs out. An expired lease is taken over. Atomic across replicas;
        `lease_s` is clamped to MAX_CLAIM_LEASE_S. A claim where none is live counts on
        the namespace's `max_records`, as a resolution does (`records_full`)."""

    @abstractmethod
    async def release(self, namespace: str, key: str, holder: str, now: float) -> bool:
        """Give up `holder`'s claim. False when another holder's live claim stands (it is
        left alone); True otherwise (released, or there was nothing live to release)."""


def clamp_ttl(ttl_s: float, limit: float) -> float:
    """A lifetime within (0, limit]: what every backend stores, whatever it is asked."""
    if math.isnan(ttl_s) or ttl_s <= 0:  # NaN or not positive: the shortest meaningful
        return 1.0
    return min(float(ttl_s), limit)


@dataclass(frozen=True)
class QuarantineRecord:
    """A blob taken out of service (or, with `digest` "", an entry withdrawn because torch
    repeatedly failed to load it): what was wrong, found by whom, and what stopped being
    offered because of it."""

    digest: str
    reason: str  # what the server found: digest, size, missing; or load (an entry)
    detail: str
    reporter: str  # a token's name, "scrub", or "anonymous" (auth off)
    at: float
    size: int
    namespaces: tuple[str, ...]  # the blob's owners (or the entry's namespace)
    withdrawn: tuple[str, ...]  # "namespace/key" of each entry no longer offered
    reporter_namespace: str = ""
    """The reporting token's namespace; "" for the scrub, auth off, and records older than
    this field. A reader of another namespace is never shown the reporter or the detail."""


MAX_QUARANTINE_RECORDS = 10_000
"""Quarantine records kept for inspection (the oldest go first; counts by reason stay)."""


class TrustStore(ABC):
    """What keeps bad bytes from being served again: quarantined blobs (why, when, who
    reported), reports of entries torch could not load, and when each blob was last
    re-hashed (the scrub's order)."""

    @abstractmethod
    async def entries_naming(self, digest: str) -> list[str]:
        """The keys of every entry that names the blob."""

    @abstractmethod
    async def blob_namespaces(self, digest: str) -> list[str]:
        """The namespaces that uploaded the blob."""

    @abstractmethod
    async def add_quarantine(self, record: QuarantineRecord) -> None:
        """Keep a quarantine record and count it under its reason (counts never go down)."""

    @abstractmethod
    async def quarantines(self, *, namespace: str | None, limit: int
                          ) -> list[QuarantineRecord]:
        """The newest records first, those touching `namespace` only (None: all)."""

    @abstractmethod
    async def quarantine_counts(self) -> dict[str, int]:
        """Quarantines ever made, by reason."""

    @abstractmethod
    async def quarantined(self, digests: list[str]) -> set[str]:
        """Which of `digests` were quarantined (and not uploaded again since)."""

    @abstractmethod
    async def clear_quarantined(self, digest: str) -> None:
        """The blob was uploaded again, verified: it may be offered once more."""

    @abstractmethod
    async def add_load_report(self, key: str, etag: str, reporter: str, now: float) -> int:
        """Note that `reporter` could not load this version of the entry; how many distinct
        reporters have said so of this version."""

    @abstractmethod
    async def mark_verified(self, digest: str, at: float) -> None:
        """The blob's bytes were re-hashed and found good at `at`."""

    @abstractmethod
    async def least_verified(self, limit: int) -> list[tuple[BlobRecord, float]]:
        """Recorded blobs with when they were last verified, longest ago first (a blob is
        verified when uploaded; 0 for records older than this bookkeeping)."""


class ProgressStore(ABC):
    """What trainers report of their jobs' time (`POST /v1/jobs/{job}/progress`), per
    (namespace, job, attempt) as a bounded summary (`progress.AttemptProgress`, folded by
    `progress.merge`), shared by every worker and replica. The same job id in two
    namespaces is two jobs."""

    async def add_progress(self, namespace: str, job: str, attempt: int, model: str | None,
                           records: list[ProgressRecord], now: float) -> None:
        """Fold `records` into the attempt's summary, atomically across processes (two
        batches of one attempt at once lose neither). A job keeps its newest
        `progress.MAX_ATTEMPTS` attempts, a namespace the `progress.MAX_JOBS` jobs that
        reported last: whatever a caller sends, what is kept stays bounded."""
        await self.add_progress_many([Fold(namespace, job, attempt, model, records, now,
                                           len(records))])

    @abstractmethod
    async def add_progress_many(self, folds: list[Fold]) -> None:
        """`add_progress` for each of `folds` (other attempts, other jobs, other namespaces)
        in one transaction or pipeline: what a server's coalesced heartbeats are written
        with (`service.beats`)."""

    @abstractmethod
    async def job_progress(self, namespace: str, job: str) -> JobProgress | None:
        """A job's attempts, oldest first; None for a job this namespace never reported."""

    async def recent_progress(self, *, namespace: str | None, since: float,
                              limit: int) -> list[JobProgress]:
        """Up to `limit` jobs of `namespace` (None: every namespace) that reported at or
        after `since` (server clock), the latest first."""
        return await self.jobs_progress(await self.recent_progress_stamps(
            namespace=namespace, since=since, limit=limit))

    @abstractmethod
    async def recent_progress_stamps(self, *, namespace: str | None, since: float,
                                     limit: int) -> list[tuple[str, str, float]]:
        """(namespace, job, last_seen) of what `recent_progress` would return, without the
        summaries: a reader that kept a job's summary from a read at the same last_seen
        need not read it again (every write of a job sets its last_seen)."""

    @abstractmethod
    async def jobs_progress(self, jobs: list[tuple[str, str, float]]) -> list[JobProgress]:
        """The jobs' attempts (given as (namespace, job, last_seen)), in the order given;
        a job with no attempts left is left out."""

    @abstractmethod
    async def prune_progress(self, before: float) -> int:
        """Drop jobs that have not reported since `before`; how many went."""


class Index(EntryStore, BlobLedger, QuotaStore, TokenStore, EventLog, RateStore, LockStore,
            JobStore, ClaimStore, TrustStore, ProgressStore):
    """Every protocol above, with the calls that span them and the index's lifecycle."""

    name: str = "abstract"

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect or create schema; called once at app start."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; called once at app stop."""

    @abstractmethod
    async def ping(self, *, write: bool = False) -> None:
        """Raise if the index cannot serve requests; `write` also proves it can still write."""

    async def eviction_facts(self, digests: list[str], now: float
                             ) -> dict[str, tuple[int, int | None]]:
        """What eviction must know of each of `digests`: its names (the entries naming
        it, plus one when a live job resolution holds it) and its recorded size (None when
        the index has no record). From three reads; a backend that can answer in one round
        trip per batch overrides it (GC asks this of every blob the entries it evicts name).
        """
        names = await self.reference_counts(digests)
        for digest in await self.held_blobs(digests, now):
            names[digest] = names.get(digest, 0) + 1
        records = await self.blob_records_of(digests)
        return {d: (names.get(d, 0), rec.size if (rec := records.get(d)) else None)
                for d in digests}


def check_precondition(condition: Precondition, current_etag: str | None) -> None:
    """Shared by every backend so they agree on conditional-write semantics."""
    if condition.if_match is not None:
        tags = _tags(condition.if_match)
        if current_etag is None or ("*" not in tags and current_etag not in tags):
            raise PreconditionFailed(
                "If-Match does not match the current entry", current_etag=current_etag
            )
    if condition.if_none_match is not None:
        tags = _tags(condition.if_none_match)
        if current_etag is not None and ("*" in tags or current_etag in tags):
            raise PreconditionFailed(
                "If-None-Match: the entry already exists", current_etag=current_etag
            )


def _tags(header: str) -> set[str]:
    return {t.strip().removeprefix("W/") for t in header.split(",") if t.strip()}


def entry_etag(manifest_json: bytes) -> str:
    """A strong ETag for an entry: changes whenever its stored manifest bytes change."""
    return '"' + hashlib.sha256(manifest_json).hexdigest()[:32] + '"'
