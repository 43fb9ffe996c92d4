"""Which job, attempt and rank this process is: read from the launcher's environment.

A remote cache is bought for the moment a job of many nodes starts or restarts, so the
client must know the job a process belongs to: the ranks of one attempt share one
resolution of each fingerprint key (no rank hits while another compiles), and a restart is
a new attempt that resolves afresh. The identity comes from whichever launcher started the
process; none of it is ever part of the fingerprint (the same model on another job must
find the same entry).

| field | read from, first found wins |
|---|---|
| job id | `MEGACACHE_JOB_ID`, `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID` (+ `.SLURM_STEP_ID`); on |
|  | Kubernetes (`KUBERNETES_SERVICE_HOST`): `JOBSET_NAME`, Kubeflow's PyTorchJob |
|  | (`MASTER_ADDR` `<job>-master-0`) and TrainJob (`<job>-node-0-0.<job>`), an Indexed |
|  | Job (`HOSTNAME` `<job>-<JOB_COMPLETION_INDEX>`); Ray Train's run name |
|  | (`ray.train.get_context()`, in a worker that imported it) |
| attempt | `MEGACACHE_ATTEMPT`, `TORCHELASTIC_RESTART_COUNT`, `SLURM_RESTART_COUNT`, |
|  | `JOBSET_RESTART_ATTEMPT`; else the node's record of the job's last run |
| rank | `RANK`, `SLURM_PROCID`; else 0 |
| local rank | `LOCAL_RANK`, `SLURM_LOCALID`; else 0 |
| world size | `WORLD_SIZE`, `SLURM_NTASKS`; else 1 |

A lone process (world size 1) that no launcher names is a job of its own command: the
node's record makes a rerun after a failure its next attempt, a rerun after it finished a
new job (`job/runs.py`; only with telemetry on, `of_process(runs_dir=...)`).

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
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

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
    source: str = ""
    """Who named the job (`explicit`, `torchelastic`, `slurm`, `jobset`, `pytorchjob`,
    `trainjob`, `k8s-job`, `ray`, `node`: the node's record of the command)."""
    attempt_known: bool = True
    """The launcher counts the attempts (else the node's record does)."""
    shared: bool = True
    """Its ranks share the cache's decisions (one resolution of each key per attempt): a
    job a launcher names. A lone process's job from the node's record has nothing to share:
    it looks up as a process without a job does (its job is for ETT)."""

    @property
    def in_job(self) -> bool:
        return self.job_id is not None

    @classmethod
    def of_process(cls, runs_dir: Path | None = None) -> tuple[JobIdentity, str]:
        """This process's identity, and why it is none ("" when the launcher's variables
        read well): a variable that is not a job id costs the job's shared decision, never
        the trainer. With `runs_dir` (the node's run records), what the launcher leaves
        out is filled from them (`job/runs.py`), once per process: later calls, with or
        without it, get the same answer."""
        try:
            found = cls.from_env()
        except JobIdentityError as exc:
            return cls(), f"job identity ignored: {exc}"
        if found.job_id is not None and found.attempt_known:
            return found, ""
        if found.job_id is None and (found.world_size > 1 or _helper_process()):
            return found, ""  # ranks of a job no launcher names, a worker: not a job
        key = (os.getpid(), found.job_id)
        if _remembered is not None and _remembered[0] == key:
            return _remembered[1], ""
        if runs_dir is None:
            return found, ""
        return _from_runs(found, runs_dir, key), ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobIdentity:
        """The identity the launcher gave this process (see the module's table)."""
        env = os.environ if env is None else env
        job_id, source = named_job(env)
        if job_id is not None and (len(job_id) > MAX_JOB_ID or not JOB_ID.fullmatch(job_id)):
            raise JobIdentityError(
                f"job id {job_id[:40]!r} must be 1-{MAX_JOB_ID} letters, digits or ._- "
                "(set MEGACACHE_JOB_ID to override the launcher's)")
        counted = [n for n in ATTEMPT_VARIABLES if env.get(n, "").strip()]
        return cls(
            job_id=job_id, source=source, attempt_known=bool(counted),
            attempt=_number(env, "attempt", 0, *ATTEMPT_VARIABLES),
            rank=_number(env, "rank", 0, "RANK", "SLURM_PROCID"),
            local_rank=_number(env, "local rank", 0, "LOCAL_RANK", "SLURM_LOCALID"),
            world_size=max(1, _number(env, "world size", 1, "WORLD_SIZE", "SLURM_NTASKS")),
        )

    def fields(self) -> dict[str, object]:
        """What an event or a manifest's producer record carries of it."""
        return {"job_id": self.job_id, "attempt": self.attempt, "rank": self.rank,
                "world_size": self.world_size}


ATTEMPT_VARIABLES = ("MEGACACHE_ATTEMPT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT",
                     "JOBSET_RESTART_ATTEMPT")
PYTORCHJOB_MASTER = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?)-master-0")
"""Kubeflow's PyTorchJob (training-operator v1) points every pod at `<job>-master-0`."""
TRAINJOB_NODE = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?)-node-0-0\.\1(\..*)?")
"""Kubeflow Trainer's TrainJob (v2) points torchrun at `<job>-node-0-0.<job>`."""

_remembered: tuple[tuple[int, str | None], JobIdentity] | None = None
"""The identity the node's run record gave this process (per process and launcher name)."""


def named_job(env: Mapping[str, str]) -> tuple[str | None, str]:
    """The job id the launcher gives, and which launcher (module's table); (None, "")."""
    explicit = _first(env, "MEGACACHE_JOB_ID")
    if explicit is not None:
        return explicit, "explicit"
    run = _first(env, "TORCHELASTIC_RUN_ID")
    if run is not None and run != "none":  # "none": torchrun without --rdzv-id
        return run, "torchelastic"
    if env.get("SLURM_JOB_ID", "").strip():
        step = env.get("SLURM_STEP_ID", "").strip()
        return env["SLURM_JOB_ID"].strip() + (f".{step}" if step else ""), "slurm"
    if env.get("KUBERNETES_SERVICE_HOST"):
        found = _kubernetes(env)
        if found[0] is not None:
            return found
    ray = _ray_run()
    return (ray, "ray") if ray is not None else (None, "")


def _kubernetes(env: Mapping[str, str]) -> tuple[str | None, str]:
    jobset = _first(env, "JOBSET_NAME")
    if jobset is not None:
        return jobset, "jobset"
    for name in ("PET_MASTER_ADDR", "MASTER_ADDR"):
        address = env.get(name, "").strip()
        if (m := TRAINJOB_NODE.fullmatch(address)) is not None:
            return m.group(1), "trainjob"
        if (m := PYTORCHJOB_MASTER.fullmatch(address.split(".")[0])) is not None:
            return m.group(1), "pytorchjob"
    index, host = env.get("JOB_COMPLETION_INDEX", "").strip(), env.get("HOSTNAME", "")
    if index.isdigit() and host.endswith(f"-{index}") and len(host) > len(index) + 1:
        return host[:-len(index) - 1], "k8s-job"
    return None, ""


LAUNCHERS = frozenset({"torchrun", "accelerate", "deepspeed", "lightning", "ray"})
"""Console scripts that start trainers: their own process is no job (its workers are)."""


def _helper_process(argv: list[str] | None = None) -> bool:
    """A process that is part of another's run, never a job of its own: a multiprocessing
    child (a spawned DataLoader worker, a pool's), a launcher (`torchrun`'s agent), or a
    module of an installed package run as a program (Inductor's compile workers, `python
    -m torch.distributed.run`): a trainer's script is the user's own."""
    import sys
    import sysconfig

    mp = sys.modules.get("multiprocessing")
    try:
        if mp is not None and mp.parent_process() is not None:
            return True
        main = Path((sys.argv if argv is None else argv)[0] or "-c")
        if main.name in LAUNCHERS:
            return True
        installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
        where = main.resolve()
        return any(where.is_relative_to(Path(d).resolve()) for d in installed if d)
    except Exception:
        return False


def _ray_run() -> str | None:
    """Ray Train's run (experiment) name, when this process is a Ray Train worker that
    has imported `ray.train` (never imported here)."""
    import sys

    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        name = train.get_context().get_experiment_name()
    except Exception:  # no Ray Train session in this process
        return None
    if not isinstance(name, str) or not name:
        return None
    return re.sub(r"[^A-Za-z0-9._-]", "-", name).strip("-._")[:MAX_JOB_ID] or None


def _from_runs(found: JobIdentity, runs_dir: Path,
               key: tuple[int, str | None]) -> JobIdentity:
    """`found` with what the node's run record adds: the job of an unnamed command, the
    attempt a launcher does not count (`job/runs.py`)."""
    global _remembered
    from megacache_client.job import runs

    command = runs.command_key()
    run = runs.begin(Path(runs_dir) / "runs",
                     f"job:{found.job_id}" if found.job_id is not None else command,
                     found.job_id)
    if run is None:
        return found
    resolved = replace(found, job_id=run.job_id, attempt=run.attempt,
                       source=found.source or "node", attempt_known=True,
                       shared=found.job_id is not None)
    _remembered = (key, resolved)
    _runs[run.job_id] = run
    return resolved


_runs: dict[str, object] = {}
"""This process's run records by job id, for its end (`ended`)."""


def ended(job: JobIdentity, reason: str) -> None:
    """The process's attempt of `job` ended (`finished` or `failed`): the node's record
    says so, for the next run of the command (nothing when no record made it)."""
    run = _runs.get(job.job_id or "")
    if run is not None:
        from megacache_client.job import runs

        runs.end(run, reason)  # type: ignore[arg-type]


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
