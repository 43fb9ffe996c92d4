"""`megacache-server`: run the service, and the maintenance commands beside it.

Flags override `MEGACACHE_*` environment variables, which override `--env-file`. Worker
processes receive the merged settings through the environment, so one code path serves
one worker or many.

Each command is one `cmd_*` function named by its parser entry (`set_defaults(fn=...)`).
One that works on the store is wrapped by `on_storage`, which checks the settings and the
storage first and hands it the cache service; its failures end it with `CommandFailed`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import json
import logging
import os
import sys
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ByteSize, ValidationError

from megacache_client.wire import exitcodes
from megacache_client.wire.environment import client_variables
from megacache_client.wire.exitcodes import ExitCode
from megacache_client.wire.manifest import is_hex64
from megacache_client.wire.signing import SigningError
from megacache_server import __version__
from megacache_server.api import supervisor
from megacache_server.cli.serve import opened_storage, serve, storage_problem
from megacache_server.errors import ApiError
from megacache_server.service.caching.cache import Cache
from megacache_server.service.housekeeping.collector import GC_NICE
from megacache_server.service.security.auth import ANONYMOUS, new_token, parse_duration
from megacache_server.service.security.signing import signer_for, write_new_key
from megacache_server.settings import Settings
from megacache_server.store.storage import local_paths, removed_on_failure

log = logging.getLogger("megacache.server")


EPILOG = ("Flags override MEGACACHE_* environment variables, which override --env-file. "
          "Sizes take units (512MiB, 8GiB). " + exitcodes.describe() + ".")
#: flags of `serve` (and of the bare command), in --help order
SERVE_FLAGS = ("host", "port", "auth", "insecure", "workers", "data_dir", "index",
               "blob_store", "s3_bucket", "s3_prefix", "s3_endpoint", "s3_region", "s3_redirect",
               "max_blob_size", "store_budget", "min_free_disk", "log_level", "log_format")
#: where the maintenance commands find the storage they work on
STORAGE_FLAGS = ("data_dir", "index", "blob_store", "s3_bucket", "s3_prefix", "s3_endpoint",
                 "s3_region")
INDEX_FLAGS = ("data_dir", "index")  # tokens live in the index only
BOOLEAN_FLAGS = ("auth", "insecure", "s3_redirect")
METAVARS = {"max_blob_size": "SIZE", "store_budget": "SIZE", "min_free_disk": "SIZE",
            "workers": "N", "index": "URL", "s3_endpoint": "URL", "data_dir": "DIR"}
DEFAULTS_SHOWN = {"index": "sqlite:///<data-dir>/index.sqlite3", "data_dir": "./megacache-data"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megacache-server", epilog=EPILOG,
        description="Remote compile cache for PyTorch 2 (content-addressed Mega-Cache bundles). "
                    "Without a command: serve.")
    parser.add_argument("--version", action="version", version=f"megacache-server {__version__}")
    _add_flags(parser, SERVE_FLAGS)
    parser.set_defaults(fn=cmd_serve)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_p = sub.add_parser("serve", help="run the HTTP service (the default)", epilog=EPILOG)
    _add_flags(serve_p, SERVE_FLAGS)
    serve_p.set_defaults(fn=cmd_serve)
    gc = sub.add_parser("gc", help="evict over-budget entries, collect unreferenced blobs")
    gc.add_argument("--dry-run", action="store_true", help="show what would go; change nothing")
    gc.add_argument("--json", action="store_true",
                    help="collect and print one JSON line of what went (the server runs its "
                         "GC this way)")
    gc.add_argument("--nice", type=int, default=0, metavar="N",
                    help="lower this process's CPU priority by N first (the server's GC: "
                         f"{GC_NICE}), so the service it runs beside gets the CPU first")
    _add_flags(gc, (*STORAGE_FLAGS, "store_budget"))
    gc.set_defaults(fn=cmd_gc)
    fsck_p = sub.add_parser("fsck", help="check index and blob store agree (exit 1 on problems)")
    fsck_p.add_argument("--repair", action="store_true",
                        help="drop dangling entries and stale records, record orphan blobs")
    fsck_p.add_argument("--verify", action="store_true", help="also re-hash every blob")
    _add_flags(fsck_p, STORAGE_FLAGS)
    fsck_p.set_defaults(fn=cmd_fsck)
    token = sub.add_parser("token", help="create, list or revoke bearer tokens")
    tsub = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    create = tsub.add_parser("create", help="create a token; printed once")
    create.add_argument("--name", required=True, help="who uses it (shown in logs)")
    create.add_argument("--scopes", default="read", help="comma list of read,write,admin "
                        "(default: read)")
    create.add_argument("--namespace", default="default", help="the one namespace it sees "
                        "(default: default)")
    create.add_argument("--expires", default=None, metavar="DURATION",
                        help="lifetime (30d, 12h, 90m, seconds); expired tokens get 401")
    _add_flags(create, INDEX_FLAGS)
    create.set_defaults(fn=cmd_token_create)
    listing = tsub.add_parser("list", help="list tokens (never their secrets)")
    _add_flags(listing, INDEX_FLAGS)
    listing.set_defaults(fn=cmd_token_list)
    revoke = tsub.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("token_id")
    _add_flags(revoke, INDEX_FLAGS)
    revoke.set_defaults(fn=cmd_token_revoke)
    keys = sub.add_parser("signing-key", help="the Ed25519 key pair that signs manifests")
    ksub = keys.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    gen = ksub.add_parser("generate", help="write a new private key; print the public key")
    gen.add_argument("--out", required=True, type=Path,
                     help="private key file to create (mode 0600; never overwritten)")
    gen.set_defaults(fn=cmd_key_generate)
    pub = ksub.add_parser("public", help="print the public key of a private key file")
    pub.add_argument("key_file", type=Path)
    pub.set_defaults(fn=cmd_key_public)
    for name, what in (("pin", "never evict"), ("unpin", "let eviction age out")):
        p = sub.add_parser(name, help=f"{what} an entry")
        p.add_argument("key", help="the entry's key (64 hex characters)")
        _add_flags(p, INDEX_FLAGS)
        p.set_defaults(fn=cmd_pin, pinned=name == "pin")
    return parser


def _add_flags(p: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Flags for Settings fields: help from the field, choices from its type, a human default.

    Every default is SUPPRESSed so only what was typed overrides the environment. The serve
    flags a command does not use are still accepted, hidden from its --help, so a script
    can pass one flag set to `serve` and to `token create` alike.
    """
    fields = Settings.model_fields
    for name in (*names, *(n for n in SERVE_FLAGS if n not in names)):
        flag = "--" + name.replace("_", "-")
        field = fields[name]
        shown = DEFAULTS_SHOWN.get(name) or _human_default(field.default)
        desc = (f"{field.description} (default {shown})" if name in names
                else argparse.SUPPRESS)
        if name in BOOLEAN_FLAGS:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=desc)
            continue
        choices = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is typing.Literal:
            p.add_argument(flag, dest=name, default=argparse.SUPPRESS, type=str.lower,
                           choices=choices, help=desc)
        else:
            p.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=desc,
                           metavar=METAVARS.get(name, name.split("_")[-1].upper()))
    p.add_argument("--env-file", default=argparse.SUPPRESS, metavar="FILE",
                   help="read MEGACACHE_* settings from this file")


def _human_default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, ByteSize):
        return human_bytes(int(value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if str(value) else "unset"


def human_bytes(n: int) -> str:
    """8589934592 -> '8GiB': the largest binary unit that divides n exactly."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def load_settings(args: argparse.Namespace) -> Settings:
    values = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    env_file = getattr(args, "env_file", None)
    return Settings(_env_file=env_file, **values)  # type: ignore[call-arg]


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """One warning per MEGACACHE_* variable that neither the server nor the client reads.

    pydantic-settings ignores them silently, so a typo (`MEGACACHE_STORE_BUGDET`) would
    otherwise leave a setting at its default with nothing said.
    """
    known = {"MEGACACHE_" + n.upper() for n in Settings.model_fields}
    known |= client_variables()
    known |= {supervisor.SUPERVISOR_ENV}
    warnings = []
    for name in sorted(environ):
        if name.startswith("MEGACACHE_") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"megacache-server: warning: {name} is not a megacache setting; "
                            f"ignored{hint}")
    return warnings


class CommandFailed(Exception):
    """Ends a command: `main` prints the message (after `megacache-server: `) on stderr and
    exits with the code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def configured(args: argparse.Namespace) -> Settings:
    """The merged settings of a command that needs them, after a warning for each unknown
    MEGACACHE_* variable; CONFIG when they cannot work."""
    for warning in unknown_environment(os.environ):
        print(warning, file=sys.stderr)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        raise CommandFailed(ExitCode.CONFIG,
                            f"invalid settings: {settings_errors(exc)}") from None
    if settings.blob_store == "s3" and importlib.util.find_spec("boto3") is None:
        raise CommandFailed(ExitCode.CONFIG, "--blob-store s3 needs boto3: "
                            "pip install 'megacache[server,s3]'")
    return settings


def cmd_serve(args: argparse.Namespace) -> int:
    settings = configured(args)
    problem = settings.exposure_problem()
    if problem:
        raise CommandFailed(ExitCode.CONFIG, problem)
    return serve(settings)


@contextlib.asynccontextmanager
async def opened_cache(settings: Settings, *, with_blobs: bool = True
                       ) -> AsyncIterator[Cache]:
    """The cache service over the configured storage: what every maintenance command uses."""
    async with opened_storage(settings, with_blobs=with_blobs) as storage:
        yield Cache(settings, storage)


StorageCommand = Callable[[Cache, argparse.Namespace], Awaitable[int]]


def on_storage(command: StorageCommand, *, with_blobs: bool = True
               ) -> Callable[[argparse.Namespace], int]:
    """A command run on the configured storage through the cache service: settings checked,
    storage reachable (else UNAVAILABLE), opened for the command and closed after it. A
    refusal of the service ends it with UNAVAILABLE when storage is down (503), else
    PROBLEM. A command that fails leaves nothing it created (`removed_on_failure`)."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        settings = configured(args)

        async def on_cache() -> int:
            async with opened_cache(settings, with_blobs=with_blobs) as cache:
                return await command(cache, args)

        with removed_on_failure(local_paths(settings, with_blobs=with_blobs)):
            problem = asyncio.run(storage_problem(settings, with_blobs=with_blobs))
            if problem:
                raise CommandFailed(ExitCode.UNAVAILABLE, f"storage unavailable: {problem}")
            try:
                return asyncio.run(on_cache())
            except ApiError as exc:
                raise CommandFailed(ExitCode.UNAVAILABLE if exc.status == 503
                                    else ExitCode.PROBLEM, exc.message) from exc

    return run


def on_index(command: StorageCommand) -> Callable[[argparse.Namespace], int]:
    """`on_storage` for a command on the index alone (tokens): the blob store is neither
    opened nor created."""
    return on_storage(command, with_blobs=False)


@on_storage
async def cmd_gc(cache: Cache, args: argparse.Namespace) -> int:
    if args.nice > 0:
        os.nice(args.nice)
    if args.json:
        return await gc_json(cache)
    return await gc_report(cache, dry_run=args.dry_run)


async def gc_report(cache: Cache, *, dry_run: bool) -> int:
    """The plan, line by line, then what went (unless `dry_run`)."""
    gc_plan = await cache.gc_plan()
    print(f"stored {gc_plan.stored_bytes} bytes; budget "
          f"{gc_plan.budget if gc_plan.budget is not None else 'none'}; "
          f"{gc_plan.kept_in_grace} unreferenced blob(s) within the "
          f"{cache.settings.gc_grace_s:.0f}s grace period kept")
    if gc_plan.kept_held:
        print(f"{gc_plan.kept_held} unreferenced blob(s) kept: a live job resolution names them")
    for key, why in gc_plan.evict:
        print(f"evict entry {key}  {why}")
    for digest, size, why, _ in gc_plan.delete:
        print(f"delete blob {digest}  {size} bytes  {why}")
    if dry_run:
        print(f"dry run: would evict {len(gc_plan.evict)} entries and delete "
              f"{len(gc_plan.delete)} blobs ({gc_plan.freed_bytes} bytes)")
        return ExitCode.OK
    done = await cache.collect(gc_plan=gc_plan)
    if done is None:
        raise CommandFailed(ExitCode.UNAVAILABLE,
                            "another collector holds the GC lock; try again later")
    print(f"evicted {done.evicted} entries, deleted {done.deleted} blobs "
          f"({done.freed_bytes} bytes), spared {done.spared}")
    if done.failed:
        raise CommandFailed(ExitCode.UNAVAILABLE,
                            f"the blob store could not delete {done.failed} blobs; they "
                            "stay on record and the next gc tries again")
    return ExitCode.OK


async def gc_json(cache: Cache) -> int:
    """One collection, its result as a JSON line: {"evicted": .., "deleted": .., ...}, or
    {"locked": true} (exit 4) when another collector holds the GC lock."""
    done = await cache.collect()
    print(json.dumps({"locked": True} if done is None else dataclasses.asdict(done)))
    return ExitCode.UNAVAILABLE if done is None else ExitCode.OK


@on_storage
async def cmd_fsck(cache: Cache, args: argparse.Namespace) -> int:
    report = await cache.check(repair=args.repair, verify=args.verify)
    for line in report.lines():
        print(line)
    return ExitCode.OK if report.clean or args.repair else ExitCode.PROBLEM


@on_index
async def cmd_token_create(cache: Cache, args: argparse.Namespace) -> int:
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
    if not await cache.revoke_token(args.token_id):
        raise CommandFailed(ExitCode.PROBLEM, f"no token {args.token_id}")
    print(f"revoked {args.token_id}")
    return ExitCode.OK


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "never"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_key_generate(args: argparse.Namespace) -> int:
    """The server keeps the private key, clients the public one (printed on stdout)."""
    try:
        public = write_new_key(args.out)
    except FileExistsError:
        raise CommandFailed(ExitCode.PROBLEM,
                            f"{args.out} exists; not overwriting a key") from None
    except (OSError, SigningError) as exc:
        raise CommandFailed(ExitCode.PROBLEM, str(exc)) from None
    print(f"wrote private key {args.out} (mode 0600): set "
          f"MEGACACHE_SIGNING_KEY_FILE={args.out} on the server; give clients "
          "MEGACACHE_VERIFY_KEY=<the line on stdout>", file=sys.stderr)
    print(public)
    return ExitCode.OK


def cmd_key_public(args: argparse.Namespace) -> int:
    try:
        public = signer_for(args.key_file).public_key
    except (OSError, SigningError) as exc:
        raise CommandFailed(ExitCode.PROBLEM, str(exc)) from None
    print(public)
    return ExitCode.OK


@on_storage
async def cmd_pin(cache: Cache, args: argparse.Namespace) -> int:
    if not is_hex64(args.key):
        raise CommandFailed(ExitCode.PROBLEM, f"no entry {args.key}")
    await cache.bound(ANONYMOUS).set_pinned(args.key, args.pinned)
    print(f"{'pinned' if args.pinned else 'unpinned'} {args.key}")
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad command line exits 2 (USAGE) here
    try:
        return int(args.fn(args))
    except CommandFailed as exc:
        print(f"megacache-server: {exc}", file=sys.stderr)
        return int(exc.code)


def settings_errors(exc: ValidationError) -> str:
    """pydantic's errors as `MEGACACHE_NAME: what is wrong (got 'value')`, one per problem."""
    parts = []
    for err in exc.errors():
        name = "MEGACACHE_" + str(err["loc"][0]).upper() if err["loc"] else "settings"
        parts.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
