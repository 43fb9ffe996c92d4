"""Client settings: keyword arguments win over `MEGACACHE_*` environment variables.

Environment variables are how `torchrun` workers are configured without code changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

Mode = Literal["off", "read-only", "read-write", "required"]
MODES: tuple[Mode, ...] = ("off", "read-only", "read-write", "required")


class ConfigError(ValueError):
    """A setting has a value the client cannot work with."""


def _default_node_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megacache"


@dataclass(frozen=True)
class ClientConfig:
    url: str = ""
    token: str | None = None
    signing_key: str | None = None
    namespace: str = "default"
    model: str | None = None
    code: str | None = None
    mode: Mode = "read-write"
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 30.0
    retries: int = 2
    node_cache_dir: Path = field(default_factory=_default_node_cache)
    max_raw_bytes: int = 16 * 1024**3
    publish_wait_s: float = 120.0
    lock_timeout_s: float = 600.0
    fallback: bool = True
    ship_kernels: bool = True
    ship_toolchain: bool = True
    precompile: bool = True
    prefetch: bool = True
    prefetch_wait_s: float = 60.0

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and bool(self.url)

    @property
    def may_publish(self) -> bool:
        return self.enabled and self.mode in ("read-write", "required")

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
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("timeouts must be positive")
        if not 0 <= self.prefetch_wait_s <= 3600:
            raise ConfigError("MEGACACHE_PREFETCH_WAIT_S must be between 0 and 3600 seconds")
        return replace(self, url=self.url.rstrip("/"), node_cache_dir=Path(self.node_cache_dir))


def _coerce(name: str, type_: Any, raw: str) -> Any:
    type_name = str(type_)
    try:
        if "bool" in type_name:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if "float" in type_name:
            return float(raw)
        if type_name == "int":
            return int(raw)
        if "Path" in type_name:
            return Path(raw).expanduser()
    except ValueError:
        raise ConfigError(f"MEGACACHE_{name.upper()}={raw!r} is not a valid {type_name}") from None
    return raw
