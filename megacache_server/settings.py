"""Server settings: CLI flags override `MEGACACHE_*` environment variables override an env file.

Sizes accept units (`512MiB`, `4GiB`, `10GB`) as well as plain byte counts.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEGACACHE_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to bind; loopback by default")
    port: int = Field(8787, ge=0, le=65535, description="TCP port")
    data_dir: Path = Field(Path("./megacache-data"), description="blobs, temp files and index")
    index: str = Field("", description="index URL: sqlite:///path or redis://host:6379/0")
    auth: bool = Field(False, description="require bearer tokens (see `megacache-server token`)")
    insecure: bool = Field(
        False, description="allow serving without auth on a non-loopback address"
    )
    allowed_hosts: str = Field(
        "", description="without auth: Host names served besides loopback ones (comma list; "
        "* = any). Guards against DNS rebinding"
    )
    token_cache_s: float = Field(
        10, ge=0, description="seconds a token lookup is cached (revocation delay)"
    )
    signing_key_file: Path | None = Field(
        None, description="Ed25519 private key (PEM) to sign manifests with; clients verify "
        "with the public key (`megacache-server signing-key generate`)"
    )
    redis_prefix: str = Field("megacache:", description="key prefix of a Redis index")
    # the names of store.storage.BLOB_STORES
    blob_store: Literal["fs", "s3"] = Field("fs", description="where blob bytes live")
    s3_bucket: str = Field("megacache", description="S3 bucket")
    s3_prefix: str = Field("", description="key prefix inside the bucket")
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (non-AWS stores)")
    s3_region: str | None = Field(None, description="S3 region")
    s3_access_key: str | None = Field(None, description="S3 key id (else AWS_* / profile)")
    s3_secret_key: str | None = Field(None, description="S3 secret (else AWS_* / profile)")
    s3_create_bucket: bool = Field(False, description="create the bucket if missing")
    s3_redirect: bool = Field(
        False, description="answer blob GETs with a 307 to a presigned URL (bytes bypass us)"
    )
    max_blob_size: ByteSize = Field(
        ByteSize(8 * 1024**3), description="largest blob a PUT may send (413 above)"
    )
    store_budget: ByteSize | None = Field(
        None, description="total blob bytes the store may hold (507 above); unset = disk-bound"
    )
    min_free_disk: ByteSize = Field(
        ByteSize(256 * 1024**2), description="free disk to keep in reserve (507 below)"
    )
    max_header_size: ByteSize = Field(ByteSize(32 * 1024), description="request headers (431)")
    header_timeout_s: float = Field(
        10, gt=0, description="a connection must send a complete header block within this "
        "long of connecting (or of its next request's first byte); else it is closed"
    )
    keepalive_timeout_s: float = Field(
        30, gt=0, description="an idle kept-alive connection is closed after this long"
    )
    max_connections: int | None = Field(
        None, ge=16, description="open connections per worker; past it the longest-idle one "
        "is closed (default: the descriptor limit less a reserve)"
    )
    max_manifest_size: ByteSize = Field(ByteSize(64 * 1024), description="largest manifest body")
    gc_grace_s: float = Field(
        3600, ge=0, description="unreferenced blobs younger than this are never collected"
    )
    gc_interval_s: float = Field(300, ge=0, description="background GC period; 0 disables")
    gc_low_water: float = Field(
        0.9, gt=0, le=1, description="eviction stops at this fraction of the store budget"
    )
    namespace_quota_bytes: ByteSize | None = Field(
        None, description="bytes of entries one namespace may hold; over it, its own least "
        "recently used entries go (unset: no quota)")
    namespace_quota_entries: int | None = Field(
        None, ge=1, description="entries one namespace may hold (unset: no quota)")
    namespace_pending_bytes: ByteSize | None = Field(
        None, description="bytes of uploaded blobs no entry names yet, per namespace (507 "
        "above; unset: a quarter of the store budget but at least two blobs, or no limit "
        "without a budget)")
    event_rate: float = Field(
        20, ge=0, description="events per second one token may post, across every worker and "
        "replica (0: no limit)")
    event_burst: float = Field(200, ge=1, description="events a token may post at once")
    event_retention_days: float = Field(
        14, gt=0, description="days raw events are kept (totals are kept for good)")
    rollup_retention_days: float = Field(
        400, gt=0, description="days hourly rollups (dashboard history) are kept")
    progress_rate: float = Field(
        50, ge=0, description="job progress batches (ETT telemetry) one token may post per "
        "second, across every worker and replica (0: no limit)")
    progress_burst: float = Field(
        500, ge=1, description="job progress batches a token may post at once")
    split_cache_bytes: ByteSize = Field(
        ByteSize(192 * 1024**2), description="memory a server process keeps jobs' ETT splits "
        "in between reads of the views over many jobs (the least recently read go first)")
    view_rate: float = Field(
        10, ge=0, description="views (listings, a job's ETT, stats, the dashboard, jobs, the "
        "trend, the quarantine, /metrics) one token may read per second, across every worker "
        "and replica (0: no limit; auth off: none)")
    view_burst: float = Field(60, ge=1, description="views a token may read at once")
    progress_flush_s: float = Field(
        1.0, ge=0, le=60, description="seconds a server process buffers heartbeat-only "
        "progress batches before writing them all in one index transaction (0: each batch "
        "written at once); other workers and replicas see a heartbeat within this")
    ett_roll_s: float = Field(
        60.0, ge=0, le=3600, description="seconds between rolls of the jobs that reported "
        "into the ETT rollups (the trend, GET /v1/ett/trend: docs/ett.md); 0: no rolls")
    progress_buffer_entries: int = Field(
        20_000, ge=1, description="job attempts with buffered heartbeats one process holds "
        "at most (past it the buffer is written early)")
    progress_namespace_attempts: int = Field(
        50_000, ge=64, description="job attempt summaries (ETT telemetry, a few KiB each) one "
        "namespace's index keeps; past it its longest-silent jobs go (at least 64: a job's "
        "attempts)")
    metrics_models_per_namespace: int = Field(
        50, ge=0, description="models one namespace shows in /metrics (its busiest by runs); "
        "the rest are summed under model=\"other\"")
    metrics_models: int = Field(
        500, ge=1, description="(namespace, model) series one /metrics scrape shows at most; "
        "past it the namespaces that ran least are summed under namespace=\"other\"")
    report_rate: float = Field(
        0.5, ge=0, description="reports of bad blobs or unloadable entries one token may send "
        "per second, across every worker and replica (0: no limit)")
    report_burst: float = Field(10, ge=1, description="reports a token may send at once")
    job_rate: float = Field(
        100, ge=0, description="job resolves and publish claims one token may make per second, "
        "across every worker and replica (0: no limit)")
    job_burst: float = Field(
        2000, ge=1, description="job resolves and claims a token may make at once (every rank "
        "of a job resolves when it starts)")
    namespace_job_records: int = Field(
        5000, ge=0, description="live job resolutions and publish claims one namespace may "
        "hold (507 above; 0: no cap)")
    withdraw_after_reports: int = Field(
        3, ge=1, description="independent reports (distinct token and job) that torch could "
        "not load an entry's bundle after which the entry is withdrawn")
    scrub_bytes_per_s: ByteSize = Field(
        ByteSize(0), description="background re-hashing of stored blobs, bytes per second "
        "(0: off, the embedded default; see docs/reliability.md)")
    scrub_interval_s: float = Field(
        7 * 86400, ge=0, description="the scrub re-hashes a blob at most once in this long")
    upload_idle_timeout_s: float = Field(
        60, gt=0, description="a body that sends nothing for this long gets 408"
    )
    min_upload_rate: ByteSize = Field(
        ByteSize(64 * 1024), description="bytes per second a request body must average once "
        "its grace period is over; slower gets 408 (0: no minimum)")
    min_upload_grace_s: float = Field(
        10, ge=0, description="seconds a request body may take before its minimum rate "
        "applies")
    workers: int = Field(1, ge=1, le=64, description="uvicorn worker processes")
    log_level: LogLevel = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="json: one JSON object per line, with a per-request access log"
    )

    @field_validator("log_level", "log_format", "blob_store", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        """`MEGACACHE_LOG_LEVEL=INFO` means info: names of choices ignore case."""
        return value.strip().lower() if isinstance(value, str) else value

    def exposure_problem(self) -> str | None:
        """Why these settings must not serve, or None: no auth is only for loopback."""
        if self.auth or self.insecure or _is_loopback(self.host):
            return None
        return (f"refusing to serve without authentication on {self.host}: set "
                "MEGACACHE_AUTH=true (and create tokens with `megacache-server token create`), "
                "bind 127.0.0.1, or pass --insecure if this network is trusted")

    def budget(self) -> int | None:
        """The store budget in bytes; None: the store is bound by its disk only."""
        return int(self.store_budget) if self.store_budget is not None else None

    def pending_cap(self) -> int | None:
        """Bytes of unreferenced uploads one namespace may hold at once."""
        if self.namespace_pending_bytes is not None:
            return int(self.namespace_pending_bytes)
        budget = self.budget()
        if budget is not None:
            return min(budget, max(budget // 4, 2 * int(self.max_blob_size)))
        return None

    def index_url(self) -> str:
        return self.index or f"sqlite:///{self.data_dir / 'index.sqlite3'}"

    def environment(self) -> dict[str, str]:
        """These settings as MEGACACHE_* variables, paths made absolute: how a child process
        (a uvicorn worker, the GC) gets exactly the settings this process merged."""
        env = {"MEGACACHE_" + name.upper(): str(value)
               for name, value in self.model_dump(exclude_none=True).items()}
        absolute = self.model_copy(update={"data_dir": self.data_dir.resolve()})
        env["MEGACACHE_DATA_DIR"] = str(absolute.data_dir)
        env["MEGACACHE_INDEX"] = absolute.index_url()
        return env


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
