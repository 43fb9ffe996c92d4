"""Which job, attempt and rank this process is: read from the launcher's environment.

A remote cache is bought for the moment a job of many nodes starts or restarts, so the
client must know the job a process belongs to: the ranks of one attempt share one
resolution of each fingerprint key (no rank hits while another compiles), and a restart is
a new attempt that resolves afresh. The identity comes from whichever launcher started the
process; none of it is ever part of the fingerprint (the same model on another job must
find the same entry).

| field | read from, first found wins |
|---|---|
| job id | `MEGACACHE_JOB_ID`, `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID` (+ `.SLURM_STEP_ID`) |
| attempt | `MEGACACHE_ATTEMPT`, `TORCHELASTIC_RESTART_COUNT`, `SLURM_RESTART_COUNT`; else 0 |
| rank | `RANK`, `SLURM_PROCID`; else 0 |
| local rank | `LOCAL_RANK`, `SLURM_LOCALID`; else 0 |
| world size | `WORLD_SIZE`, `SLURM_NTASKS`; else 1 |

The job's allocation start (when the scheduler gave it its resources, for its Effective
Training Time) is `MEGACACHE_JOB_START` (unix seconds or ISO 8601), else
`SLURM_JOB_START_TIME` (unix seconds): `allocation_start()`.

torchrun's default run id `none` is no job id: it is the same for every job started
without `--rdzv-id`. A process without a job id behaves as a lone process always has.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

MAX_JOB_ID = 128
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What a job id may hold (the server's rule too): no `/`, no spaces, nothing odd."""
RESOLUTION_TTL_S = 6 * 3600.0
"""How long the server keeps a job attempt's resolutions after the last rank asked."""
MAX_ATTEMPT = 10**6


class JobIdentityError(ValueError):
    """A launcher variable holds something that is not a job id, attempt or rank."""


@dataclass(frozen=True)
class JobIdentity:
    job_id: str | None = None
    attempt: int = 0
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def in_job(self) -> bool:
        return self.job_id is not None

    @classmethod
    def of_process(cls) -> tuple[JobIdentity, str]:
        """This process's identity, and why it is none ("" when the launcher's variables
        read well): a variable that is not a job id costs the job's shared decision, never
        the trainer."""
        try:
            return cls.from_env(), ""
        except JobIdentityError as exc:
            return cls(), f"job identity ignored: {exc}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobIdentity:
        """The identity the launcher gave this process (see the module's table)."""
        env = os.environ if env is None else env
        job_id = _first(env, "MEGACACHE_JOB_ID", "TORCHELASTIC_RUN_ID")
        if job_id == "none" and "MEGACACHE_JOB_ID" not in env:
            job_id = None  # torchrun without --rdzv-id: every such job shares it
        if job_id is None and env.get("SLURM_JOB_ID"):
            step = env.get("SLURM_STEP_ID")
            job_id = env["SLURM_JOB_ID"] + (f".{step}" if step else "")
        if job_id is not None and (len(job_id) > MAX_JOB_ID or not JOB_ID.fullmatch(job_id)):
            raise JobIdentityError(
                f"job id {job_id[:40]!r} must be 1-{MAX_JOB_ID} letters, digits or ._- "
                "(set MEGACACHE_JOB_ID to override the launcher's)")
        return cls(
            job_id=job_id,
            attempt=_number(env, "attempt", 0, "MEGACACHE_ATTEMPT",
                            "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"),
            rank=_number(env, "rank", 0, "RANK", "SLURM_PROCID"),
            local_rank=_number(env, "local rank", 0, "LOCAL_RANK", "SLURM_LOCALID"),
            world_size=max(1, _number(env, "world size", 1, "WORLD_SIZE", "SLURM_NTASKS")),
        )

    def fields(self) -> dict[str, object]:
        """What an event or a manifest's producer record carries of it."""
        return {"job_id": self.job_id, "attempt": self.attempt, "rank": self.rank,
                "world_size": self.world_size}


def allocation_start(env: Mapping[str, str] | None = None) -> float | None:
    """When the job's resources were allocated, from `MEGACACHE_JOB_START` (unix seconds or
    ISO 8601 with a zone) or `SLURM_JOB_START_TIME`; None when neither reads as a time."""
    env = os.environ if env is None else env
    for name in ("MEGACACHE_JOB_START", "SLURM_JOB_START_TIME"):
        text = env.get(name, "").strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            try:
                when = datetime.fromisoformat(text.replace("Z", "+00:00"))
            except ValueError:
                continue
            if when.tzinfo is None:
                continue  # a time without a zone is no instant
            value = when.timestamp()
        if math.isfinite(value) and value > 0:
            return value
    return None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return None


def _number(env: Mapping[str, str], what: str, default: int, *names: str) -> int:
    for name in names:
        text = env.get(name, "").strip()
        if not text:
            continue
        if not text.isascii() or not text.isdigit() or int(text) > MAX_ATTEMPT:
            raise JobIdentityError(f"{name}={text[:40]!r} is not a {what} "
                                   f"(a whole number up to {MAX_ATTEMPT})")
        return int(text)
    return default
