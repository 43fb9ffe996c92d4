"""What every `megacache` command shares: the server's client made from the options, the
key a trainer here computes, the table printer and byte units, and the errors that set the
exit code. Apart from the commands (`entries`, `explain`, `stats`, `jobs`, `autoload`) so
that each imports it and none imports another or the parser (`cli/__init__.py`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from megacache_client.config import ClientConfig, ConfigError
from megacache_client.transport.breaker import CircuitBreaker
from megacache_client.transport.client import RemoteCache
from megacache_client.wire.escape import escape
from megacache_client.wire.manifest import Fingerprint


class UsageError(ValueError):
    """An argument argparse could not check itself (exit 2, like argparse's own errors)."""


class NotFound(LookupError):
    """What the command was asked about is not there (exit 1)."""


def config(args: argparse.Namespace, **overrides: Any) -> ClientConfig:
    """The settings from the environment and --url/--token; a server is needed."""
    found = ClientConfig.from_env(url=args.url, token=args.token, **overrides)
    if not found.url:
        raise ConfigError("no server: pass --url or set MEGACACHE_URL")
    return found


def remote(config: ClientConfig) -> RemoteCache:
    """A command's own breaker: one typed by a person is not held back by the node's (a
    server that was down for the training ranks a minute ago may be fixed by now)."""
    return RemoteCache(config, CircuitBreaker())


def torch_problem() -> str:
    """Why this environment's torch cannot use the cache ("" when it can)."""
    from megacache_client.torch import supported

    return supported.problem()


def as_a_trainer(config: ClientConfig, options: dict[str, Any] | None = None) -> Fingerprint:
    """The key a trainer with these settings computes. Precompiled Dynamo (on by default) is
    part of the config component, so it is switched on here as `enable` does: a key computed
    without it would never be a trainer's (its push only ever a fallback)."""
    from megacache_client.steps.fingerprint import compute
    from megacache_client.torch import precompile

    precompile.turn_on(config)
    return compute(namespace=config.namespace, options=options, model=config.model,
                   code=config.code)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Columns as wide as their widest cell; a column of figures is right-aligned, so its
    digits line up (blank and "-" cells count as figures). A cell is the server's text:
    escaped (a right-to-left override would reorder the row, an ESC repaint the terminal)."""
    cells = [list(map(str, header))] + [[escape(c, 256) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = [all(_figure(r[i]) for r in cells[1:]) and len(cells) > 1
             for i in range(len(header))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if r else c.ljust(w)
                        for c, w, r in zip(row, widths, right, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _figure(cell: str) -> bool:
    """A number as the tables print them: 12, 3.4, 56%, 1.2 kB, 47ms, or none ("", "-")."""
    text = cell.removesuffix("%").removesuffix("ms").lstrip("<").split(" ")[0]
    try:
        float(text)
    except ValueError:
        return cell in ("", "-")
    return True


def size(n: float) -> str:
    scale, unit = byte_unit(n)
    return f"{n / scale:.1f} {unit}"


def byte_unit(n: float) -> tuple[float, str]:
    """The decimal unit a byte count reads best in (B, kB, MB, GB): a 40 kB blob is not
    "0.0 MB"."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return scale, unit
    return 1.0, "B"
