"""Client settings: keyword arguments win over `MEGACACHE_*` environment variables.

Environment variables are how `torchrun` workers are configured without code changes, so a
value that is not what it claims to be is refused with an error naming the variable, never
read as something else: `MEGACACHE_FALLBACK=flase` is an error, not false. Sizes take units
as the server's settings do (`16GiB`, `512MB`, or a plain byte count).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from megacache_client.wire.progress import HEARTBEAT_S, MODEL_CAP
from megacache_client.wire.signing import SigningError, parse_origins, public_key_bytes
from megacache_client.wire.text import escape_foreign, text_error
from megacache_client.wire.writers import WriterPolicy

Mode = Literal["off", "read-only", "read-write", "required"]
MODES: tuple[Mode, ...] = ("off", "read-only", "read-write", "required")


Bytes = int
"""A size in bytes; from text it may carry a unit (`16GiB`, `512MB`), as on the server."""

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
DEFAULT_LOAD_DEADLINE_S = 10.0
"""A healthy server answers an entry lookup in milliseconds; a busy one facing a thousand
starting ranks in well under a second. Ten seconds is long enough never to give up on a
slow-but-working server and short enough that a hung one costs a trainer next to nothing
next to the minutes of a cold compile (it used to cost ~97 s)."""


class ConfigError(ValueError):
    """A setting has a value the client cannot work with."""


def _default_node_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megacache"


@dataclass(frozen=True)
class ClientConfig:
    url: str = ""
    token: str | None = None
    verify_key: str | None = None
    namespace: str = "default"
    model: str | None = None
    code: str | None = None
    mode: Mode = "read-write"
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 30.0
    retries: int = 2
    load_deadline_s: float = DEFAULT_LOAD_DEADLINE_S
    breaker_reset_s: float = 30.0
    node_cache_dir: Path = field(default_factory=_default_node_cache)
    max_raw_bytes: Bytes = 16 * 1024**3
    publish_wait_s: float = 120.0
    claim_lease_s: float = 600.0
    lock_timeout_s: float = 600.0
    fallback: bool = True
    ship_kernels: bool = True
    ship_toolchain: bool = True
    precompile: bool = True
    """torch's precompiled Dynamo: recorded, checked in a child process by the publisher, and
    loaded only where verified (docs/precompiled-dynamo.md); `MEGACACHE_PRECOMPILE=0` turns
    it off entirely."""
    prefetch: bool = True
    prefetch_wait_s: float = 60.0
    trusted_writers: str = ""
    """Whose entries this process runs (`transport/trust.py`): token names, `ci-*`, `scope:admin`;
    empty runs anyone's."""
    redirect_origins: str = ""
    """Origins (`https://s3.internal:9000`, comma- or space-separated) a blob download may be
    redirected to besides the server's own and the one it announces
    (`transport/redirects.py`): the operator's word, for any address, link-local included."""
    telemetry: bool = True
    """Rank 0 of a job sends its progress (steps, heartbeats, checkpoints) for the job's
    Effective Training Time (`ett/telemetry.py`); `MEGACACHE_TELEMETRY=0` turns it off."""
    heartbeat_s: float = HEARTBEAT_S
    publish_early: bool = True
    """Publish once a compile has settled (the step after it completed), in the background,
    and again after later compiles (`steps/settle.py`); `MEGACACHE_PUBLISH_EARLY=0`: only at
    the process's exit, as before (a killed process then leaves nothing behind)."""
    max_publishes: int = 4
    """Publish rounds one process may run (settled points and the exit together)."""
    term_grace_s: float = 20.0
    """On SIGTERM, how long the client may finish a publish under way and send the job's
    last progress before the signal goes on to the trainer's (or the default) handler
    (`steps/preemption.py`); 0 hands it on at once. Below the launcher's own grace
    (torchrun, Kubernetes and SLURM give 30 s before SIGKILL)."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and bool(self.url)

    @property
    def may_publish(self) -> bool:
        return self.enabled and self.mode in ("read-write", "required")

    @property
    def writer_policy(self) -> WriterPolicy | None:
        return WriterPolicy.parse(self.trusted_writers)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> ClientConfig:
        """Build from `MEGACACHE_<FIELD>` variables, then apply non-None keyword overrides."""
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("MEGACACHE_" + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _coerce(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        return config.validated()

    def validated(self) -> ClientConfig:
        if self.mode not in MODES:
            raise ConfigError(
                f"MEGACACHE_MODE must be one of {', '.join(MODES)}, not {self.mode!r}"
            )
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"MEGACACHE_URL must start with http:// or https://: {self.url!r}")
        for name in ("connect_timeout_s", "read_timeout_s", "load_deadline_s",
                     "breaker_reset_s", "claim_lease_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MEGACACHE_{name.upper()} must be positive, "
                                  f"not {getattr(self, name)}")
        if self.claim_lease_s > 900:
            raise ConfigError("MEGACACHE_CLAIM_LEASE_S must be at most 900 seconds (the "
                              "server's limit)")
        if not 0 <= self.prefetch_wait_s <= 3600:
            raise ConfigError("MEGACACHE_PREFETCH_WAIT_S must be between 0 and 3600 seconds")
        if not 0 < self.heartbeat_s <= 3600:
            raise ConfigError("MEGACACHE_HEARTBEAT_S must be above 0 and at most 3600 seconds")
        if not 0 <= self.term_grace_s <= 60:
            raise ConfigError("MEGACACHE_TERM_GRACE_S must be between 0 and 60 seconds (the "
                              "launcher's SIGKILL follows within about 30)")
        if not 1 <= self.max_publishes <= 100:
            raise ConfigError(f"MEGACACHE_MAX_PUBLISHES must be between 1 and 100, not "
                              f"{self.max_publishes}")
        if self.retries < 0:
            raise ConfigError(f"MEGACACHE_RETRIES must be 0 or more, not {self.retries}")
        if self.verify_key:
            try:
                public_key_bytes(self.verify_key)
            except SigningError as exc:
                raise ConfigError(f"MEGACACHE_VERIFY_KEY: {exc}") from None
        try:
            WriterPolicy.parse(self.trusted_writers)
        except ValueError as exc:
            raise ConfigError(f"MEGACACHE_TRUSTED_WRITERS: {exc}") from None
        try:
            parse_origins(self.redirect_origins)
        except ValueError as exc:
            raise ConfigError(f"MEGACACHE_REDIRECT_ORIGINS: {exc}") from None
        max_raw = self.max_raw_bytes
        if isinstance(max_raw, str):  # a keyword argument may use units too
            max_raw = _coerce("max_raw_bytes", "Bytes", max_raw)
        if max_raw <= 0:
            raise ConfigError(f"MEGACACHE_MAX_RAW_BYTES must be positive, not {max_raw}")
        return replace(self, url=self.url.rstrip("/"), node_cache_dir=Path(self.node_cache_dir),
                       max_raw_bytes=max_raw, model=_text_model(self.model),
                       code=_text_model(self.code, "MEGACACHE_CODE"))


def _text_model(model: str | None, variable: str = "MEGACACHE_MODEL") -> str | None:
    """`model` (or `MEGACACHE_CODE`) if it is wire text, else None with one warning: a
    name with a control character or a non-UTF-8 byte (a surrogateescape str from the
    environment) would be refused by the server on every progress batch (a code name: on
    every manifest) and retried for ever; the trainer runs
    on without the name instead (the default name applies)."""
    if model is None or model == "":
        return model or None
    why = text_error(model, MODEL_CAP)
    if why is None:
        return model
    logging.getLogger("megacache").warning(
        "megacache: %s %s ignored: %s", variable, escape_foreign(model, 80), why)
    return None


def _parse_bytes(text: str) -> int:
    """`16GiB`, `512MB` or a plain count, with the server's parser (pydantic's ByteSize).

    A plain count needs no parser: pydantic (~150 ms to import) is only loaded for units."""
    if text.isascii() and text.isdigit():
        return int(text)
    from pydantic import ValidationError

    try:
        return int(_byte_size().validate_python(text))
    except ValidationError as exc:
        raise ValueError(str(exc)) from None


@functools.cache
def _byte_size() -> Any:
    """pydantic's ByteSize adapter, built on first use: importing and building it costs
    50-100 ms, paid at every trainer's start (the client is imported right after torch)
    although few set a size in the environment."""
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize)


def _coerce(name: str, type_: Any, raw: str) -> Any:
    """Text from the environment as the field's type, or a ConfigError naming the variable."""
    type_name = str(type_)
    text = raw.strip()
    try:
        if type_name == "bool":
            if text.lower() in TRUE:
                return True
            if text.lower() in FALSE:
                return False
            raise ValueError
        if type_name == "float":
            return float(text)
        if type_name == "int":
            return int(text)
        if type_name == "Bytes":
            return _parse_bytes(text)
        if "Path" in type_name:
            return Path(text).expanduser()
    except ValueError:
        expected = {"bool": f"a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)})",
                    "Bytes": "a size in bytes, with an optional unit (16GiB, 512MB, 1000000)",
                    "float": "a number", "int": "a whole number"}.get(type_name, type_name)
        raise ConfigError(f"MEGACACHE_{name.upper()}={raw!r} is not {expected}") from None
    return raw
