"""Every key the Redis index writes, all under one prefix (default `megacache:`).

  entry:{key}            hash   manifest, etag, namespace, model, env, hw, size, digests,
                                times, pinned
  refs:{digest}          set    entry keys naming the blob (garbage collection)
  seq:{key}              int    the last sequence number a version of the key got (kept after
                                the entry goes: versions count up across re-creates)
  by_model:{model}       zset   entry keys by created_at (fallback lookup)
  by_envhw:{env}:{hw}    zset   entry keys by created_at (publish-side lookup)
  entries / ns:{ns}      zset   every entry key (of a namespace) by created_at
  lru / lru:{ns}         zset   entry keys by last access (eviction, quotas)
  sizes / sizes:{ns}     zset   entry keys by stored bytes (largest entries)
  usage                  hash   {ns}:entries, {ns}:bytes and *:entries, *:bytes
  blobs                  hash   digest -> size;  blob_touched  zset digest -> last touch
  unref                  set    blobs that may have no reference left: every blob recorded or
                                left by an entry that went, until GC finds it named again
                                (`unref_ready`: while set, the set covers every blob)
  owned:{ns}             set    digests a namespace uploaded; blob_owners:{digest} the reverse
  pending_gen:{ns}       int    bumped by every upload a namespace records (quota holds)
  holds:{ns}             zset   hold id -> expiry: uploads in flight on the pending quota
  hold_sizes:{ns}        hash   hold id -> bytes it holds (both expire a minute after the last)
  stored_bytes           int    sum of recorded blob sizes (the store budget)
  blob_verified          zset   digest -> when its bytes were last hashed (the scrub's order)
  quarantine             list   quarantine records, newest first (JSON, capped)
  quarantine_counts      hash   reason -> quarantines ever made
  quarantined            set    digests quarantined and not uploaded again since
  load_reports:{key}:{etag}
                         set    who reported that torch could not load this entry version
  tokens / token:{id}    zset / hash   token ids by creation; a token's record (its hash)
  events:{ns}            list   recent raw events (capped)
  total:{ns}             hash   "{model}\\t{counter}" -> running total (never goes down)
  rollup:{ns}:{hour}     hash   the same, per hour (expires with the retention)
  hourly:{ns}:{hour}     hash   "{counter}" -> the hour's sum over every model (the timeline
                                reads 11 fields an hour, not 11 per model)
  misses:{ns}:{hour}     zset   [model, outcome, reason] -> count
  gen:{ns}:{hour}        int    events counted into that hour's rollups: a process keeps
                                decoded periods until their generation moves (period_sums)
  (rollup, hourly, misses and gen also exist as `{kind}_day:{ns}:{day}`, per UTC day)
  daily_from             float  when this store began writing daily rollups
  attempt:{ns}:{job}:{n} hash   a job attempt as its ranks reported it: the slowest rank's
                                time and outcome, compile seconds, model and hour it counts
                                in (rollups.AttemptState; expires)
  jobs:{ns}              zset   job id -> last report (at most rollups.MAX_JOBS)
  attempts:{ns}:{job}    zset   a job's attempt numbers
  namespaces             set    namespaces that reported events
  models:{ns}            set    model names its rollups count (at most rollups.MAX_MODELS)
  lock:{name}            str    the owner of a lock shared by every replica (expires)
  job:{ns}:{job}:{attempt}:{key}
                         hash   a job attempt's resolution of a key: manifest ("" for a miss),
                                etag, entry_ns, digests, resolved_at, expires_at (expires)
  held                   zset   digest -> latest expiry of the live resolutions naming it (GC)
  claim:{ns}:{key}       hash   a publish claim: holder, expires_at (expires)
  jobrecs:{ns}           zset   job:… and claim:… key -> expiry: a namespace's live records,
                                counted against MEGACACHE_NAMESPACE_JOB_RECORDS (expires)
  progress:{ns}:{job}    hash   attempt -> the attempt's progress summary (JSON,
                                progress.AttemptProgress; at most progress.MAX_ATTEMPTS)
  progress_at:{ns}:{job} hash   attempt -> server time of its summary's last write (a
                                reader's stamp: a job's unchanged attempts are not read again)
  progress_jobs:{ns}     zset   job id -> last progress batch (at most progress.MAX_JOBS)
  progress_ns            set    namespaces that reported progress
  progress_attempts      hash   namespace -> attempts its progress:{ns}:* hashes hold (the
                                progress budget's count; a replica racing a fold may skew it
                                by the attempts of one job)
  progress_counted       set    namespaces whose progress_attempts count is whole (counted
                                from their hashes once: older servers kept no count)
  ett_contrib:{ns}:{job} str    a job's part of the ETT rollups (JSON,
                                ett_rollups.Contribution: its counters per hour)
  ett_row:{ns}:{p}:{start}
                         hash   model -> the sum of the contributions for the hour (p=h)
                                or day (p=d) starting then, a JSON list in
                                ett_rollups.COUNTERS order (expires when no longer kept)
  ett_lost:{ns} / ett_seen:{ns}
                         zset   job -> its lost seconds / its last roll's last_seen
  ett_models:{ns}        set    models the namespace's ETT rows name
  ett_ns                 set    namespaces with ETT rows;  ett_mark  float: the last roll
  rate:{bucket}          hash   a token bucket: tokens, at (expires once it would be full)
  heartbeat              float  the last write readiness made

The scripts in `scripts/` build the same names from the prefix they are given: a key renamed
here is renamed there too.
"""

from __future__ import annotations

Part = str | int | None


class Keys:
    """The names of the index's keys under `prefix`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _name(self, *parts: Part) -> str:
        return self.prefix + ":".join("" if p is None else str(p) for p in parts)

    # -- entries ----------------------------------------------------------------------
    def entry(self, key: str) -> str:
        return self._name("entry", key)

    def sequence(self, key: str) -> str:
        return self._name("seq", key)

    def refs(self, digest: str | None) -> str:
        return self._name("refs", digest)

    def by_model(self, model: str | None) -> str:
        return self._name("by_model", model)

    def by_envhw(self, env: str | None, hw: str | None) -> str:
        return self._name("by_envhw", env, hw)

    def created(self, namespace: str | None = None) -> str:
        """Entry keys by created_at: every one, or a namespace's."""
        return self._name("entries") if namespace is None else self._name("ns", namespace)

    def lru(self, namespace: str | None = None) -> str:
        return self._name("lru") if namespace is None else self._name("lru", namespace)

    def sizes(self, namespace: str | None = None) -> str:
        return self._name("sizes") if namespace is None else self._name("sizes", namespace)

    def usage(self) -> str:
        return self._name("usage")

    # -- blobs ------------------------------------------------------------------------
    def blobs(self) -> str:
        return self._name("blobs")

    def blob_touched(self) -> str:
        return self._name("blob_touched")

    def unref(self) -> str:
        return self._name("unref")

    def unref_ready(self) -> str:
        return self._name("unref_ready")

    def owned(self, namespace: str) -> str:
        return self._name("owned", namespace)

    def blob_owners(self, digest: str) -> str:
        return self._name("blob_owners", digest)

    def pending_gen(self, namespace: str) -> str:
        return self._name("pending_gen", namespace)

    def holds(self, namespace: str) -> str:
        return self._name("holds", namespace)

    def hold_sizes(self, namespace: str) -> str:
        return self._name("hold_sizes", namespace)

    def stored_bytes(self) -> str:
        return self._name("stored_bytes")

    # -- trust: verification, quarantine, load reports ------------------------------------
    def blob_verified(self) -> str:
        return self._name("blob_verified")

    def quarantine(self) -> str:
        return self._name("quarantine")

    def quarantine_counts(self) -> str:
        return self._name("quarantine_counts")

    def quarantined(self) -> str:
        return self._name("quarantined")

    def load_reports(self, key: str, etag: str) -> str:
        return self._name("load_reports", key, etag)

    # -- tokens -----------------------------------------------------------------------
    def tokens(self) -> str:
        return self._name("tokens")

    def token(self, token_id: str) -> str:
        return self._name("token", token_id)

    # -- events -----------------------------------------------------------------------
    def events(self, namespace: str) -> str:
        return self._name("events", namespace)

    def total(self, namespace: str) -> str:
        return self._name("total", namespace)

    def period(self, kind: str, namespace: str, start: int, *, daily: bool = False) -> str:
        """A rollup of one hour (or UTC day): `kind` is rollup, hourly, misses or gen."""
        return self._name(f"{kind}_day" if daily else kind, namespace, start)

    def attempt(self, namespace: str, job: str, attempt: int) -> str:
        return self._name("attempt", namespace, job, attempt)

    def jobs(self, namespace: str) -> str:
        return self._name("jobs", namespace)

    def job_attempts(self, namespace: str, job: str) -> str:
        return self._name("attempts", namespace, job)

    def daily_from(self) -> str:
        return self._name("daily_from")

    def namespaces(self) -> str:
        return self._name("namespaces")

    def models(self, namespace: str) -> str:
        return self._name("models", namespace)

    # -- jobs and claims (the scripts resolve.lua, claim.lua, release.lua build these too) --
    def job(self, namespace: str, job: str, attempt: int, key: str) -> str:
        return self._name("job", namespace, job, attempt, key)

    def held(self) -> str:
        return self._name("held")

    def claim(self, namespace: str, key: str) -> str:
        return self._name("claim", namespace, key)

    def progress(self, namespace: str, job: str) -> str:
        return self._name("progress", namespace, job)

    def progress_at(self, namespace: str, job: str) -> str:
        return self._name("progress_at", namespace, job)

    def progress_jobs(self, namespace: str) -> str:
        return self._name("progress_jobs", namespace)

    def progress_namespaces(self) -> str:
        return self._name("progress_ns")

    def progress_attempts(self) -> str:
        return self._name("progress_attempts")

    def progress_counted(self) -> str:
        return self._name("progress_counted")

    def ett_contrib(self, namespace: str, job: str) -> str:
        return self._name("ett_contrib", namespace, job)

    def ett_row(self, namespace: str, period: str, start: int) -> str:
        return self._name("ett_row", namespace, period, start)

    def ett_lost(self, namespace: str) -> str:
        return self._name("ett_lost", namespace)

    def ett_seen(self, namespace: str) -> str:
        return self._name("ett_seen", namespace)

    def ett_models(self, namespace: str) -> str:
        return self._name("ett_models", namespace)

    def ett_namespaces(self) -> str:
        return self._name("ett_ns")

    def ett_mark(self) -> str:
        return self._name("ett_mark")

    def rate(self, bucket: str) -> str:
        return self._name("rate", bucket)

    # -- locks and health ---------------------------------------------------------------
    def lock(self, name: str) -> str:
        return self._name("lock", name)

    def heartbeat(self) -> str:
        return self._name("heartbeat")
