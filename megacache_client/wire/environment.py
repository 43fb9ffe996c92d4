"""The `MEGACACHE_*` variables a trainer's client reads.

Trainers and servers often share one environment (a compose file, a Kubernetes ConfigMap):
the server warns about a `MEGACACHE_*` variable neither side reads (a typo leaves a setting
at its default with nothing said), so it must know the client's names without importing
the client. `ClientConfig`'s fields are the settings (a test checks the two agree).
"""

from __future__ import annotations

CLIENT_SETTINGS = (
    "url", "token", "verify_key", "namespace", "model", "code", "mode", "connect_timeout_s",
    "read_timeout_s", "retries", "load_deadline_s", "breaker_reset_s", "node_cache_dir",
    "max_raw_bytes", "publish_wait_s", "claim_lease_s", "lock_timeout_s", "fallback",
    "ship_kernels", "ship_toolchain", "precompile", "prefetch", "prefetch_wait_s",
    "trusted_writers", "redirect_origins", "telemetry", "heartbeat_s", "publish_early",
    "max_publishes", "term_grace_s",
)
JOB_VARIABLES = ("MEGACACHE_JOB_ID", "MEGACACHE_ATTEMPT", "MEGACACHE_JOB_START")
"""Read by `megacache_client.job`: the launcher's job id and attempt, overridden, and when
the job's resources were allocated (for its Effective Training Time)."""


def client_variables() -> frozenset[str]:
    """Every `MEGACACHE_*` name the client reads."""
    return frozenset({"MEGACACHE_" + name.upper() for name in CLIENT_SETTINGS}
                     | set(JOB_VARIABLES))
