"""`megacache-server token create|list|revoke`: the bearer tokens, kept in the index alone
(`runner.on_index`); a token is printed once, only its hash is stored."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone

from megacache_client.wire.exitcodes import ExitCode
from megacache_server.cli.runner import CommandFailed, on_index
from megacache_server.service.caching.cache import Cache
from megacache_server.service.security.auth import new_token, parse_duration


@on_index
async def cmd_token_create(cache: Cache, args: argparse.Namespace) -> int:
    """The secret on stdout (for a script to take), what it may do on stderr."""
    scopes = tuple(s.strip() for s in args.scopes.split(",") if s.strip())
    try:
        lifetime = parse_duration(args.expires) if args.expires else None
        token, record = new_token(args.name, scopes, args.namespace, lifetime)
    except ValueError as exc:
        raise CommandFailed(ExitCode.USAGE, str(exc)) from None
    await cache.add_token(record)
    print(token)
    print(f"created token {record.token_id} for {record.name!r}: scopes "
          f"{','.join(record.scopes)}, namespace {record.namespace!r}, expires "
          f"{_when(record.expires_at)} (shown once; only its hash is stored)", file=sys.stderr)
    return ExitCode.OK


@on_index
async def cmd_token_list(cache: Cache, args: argparse.Namespace) -> int:
    """Every token's id, name, scopes, namespace and state; never a secret."""
    now = time.time()
    rows = [(t.token_id, t.name, ",".join(t.scopes), t.namespace,
             "revoked" if t.revoked else "expired" if t.expired(now) else
             f"active until {_when(t.expires_at)}") for t in await cache.tokens()]
    if rows:  # none: nothing on stdout
        _columns([("id", "name", "scopes", "namespace", "state"), *rows])
    return ExitCode.OK


def _columns(rows: Sequence[Sequence[str]]) -> None:
    """Rows (a header first) in columns as wide as their widest cell: a long name does not
    push the rest of its row out of line."""
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@on_index
async def cmd_token_revoke(cache: Cache, args: argparse.Namespace) -> int:
    """PROBLEM when there is no such token, so a typo is not taken for a revocation."""
    if not await cache.revoke_token(args.token_id):
        raise CommandFailed(ExitCode.PROBLEM, f"no token {args.token_id}")
    print(f"revoked {args.token_id}")
    return ExitCode.OK


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "never"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
