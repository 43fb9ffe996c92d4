"""`megacache-server`: run the service.

Flags override `MEGACACHE_*` environment variables, which override `--env-file`. Worker
processes receive the merged settings through the environment, so one code path serves
one worker or many.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from megacache_client.manifest import is_hex64
from megacache_client.signing import SigningError
from megacache_server.auth import ANONYMOUS, new_token, parse_duration
from megacache_server.cache import Cache
from megacache_server.errors import ApiError
from megacache_server.settings import Settings
from megacache_server.signing import signer_for, write_new_key
from megacache_server.storage import build_storage


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    _add_serve_flags(common)
    parser = argparse.ArgumentParser(
        prog="megacache-server", parents=[common],
        description="Remote compile cache for PyTorch 2 (content-addressed Mega-Cache bundles).",
    )
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", parents=[common], help="run the HTTP service (the default command)")
    gc = sub.add_parser("gc", parents=[common],
                        help="evict over-budget entries (LRU) and collect unreferenced blobs")
    gc.add_argument("--dry-run", action="store_true", help="show what would go; change nothing")
    fsck_p = sub.add_parser("fsck", parents=[common],
                          help="check index and blob store agree (exit 1 on problems)")
    fsck_p.add_argument("--repair", action="store_true",
                      help="drop dangling entries and stale records, record orphan blobs")
    fsck_p.add_argument("--verify", action="store_true",
                      help="also re-hash every blob (reads everything)")
    token = sub.add_parser("token", help="manage bearer tokens (stored hashed in the index)")
    tsub = token.add_subparsers(dest="token_command", required=True)
    create = tsub.add_parser("create", parents=[common], help="create a token; printed once")
    create.add_argument("--name", required=True, help="who or what uses it (shown in logs)")
    create.add_argument("--scopes", default="read", help="comma list of read,write,admin")
    create.add_argument("--namespace", default="default", help="the one namespace it sees")
    create.add_argument("--expires", default=None,
                        help="lifetime (30d, 12h, 90m, seconds); expired tokens get 401")
    tsub.add_parser("list", parents=[common], help="list tokens (never their secrets)")
    revoke = tsub.add_parser("revoke", parents=[common], help="revoke a token by id")
    revoke.add_argument("token_id")
    keys = sub.add_parser("signing-key", help="the Ed25519 key pair that signs manifests")
    ksub = keys.add_subparsers(dest="key_command", required=True)
    gen = ksub.add_parser("generate", help="write a new private key; print the public key")
    gen.add_argument("--out", required=True, type=Path,
                     help="private key file to create (mode 0600; never overwritten)")
    pub = ksub.add_parser("public", help="print the public key of a private key file")
    pub.add_argument("key_file", type=Path)
    for name, what in (("pin", "never evict"), ("unpin", "let eviction age out")):
        p = sub.add_parser(name, parents=[common], help=f"{what} an entry")
        p.add_argument("key")
    return parser


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    fields = Settings.model_fields
    p.add_argument("--insecure", dest="insecure", action="store_const", const=True,
                   default=argparse.SUPPRESS,
                   help="serve without auth on a non-loopback address (trusted networks only)")
    p.add_argument("--auth", dest="auth", action="store_const", const=True,
                   default=argparse.SUPPRESS, help="require bearer tokens [env MEGACACHE_AUTH]")
    for name in ("host", "port", "data_dir", "index", "blob_store", "s3_bucket", "s3_prefix",
                 "s3_endpoint", "s3_region", "s3_redirect", "max_blob_size", "store_budget",
                 "min_free_disk", "workers", "log_level", "log_format", "signing_key_file"):
        flag = "--" + name.replace("_", "-")
        env = "MEGACACHE_" + name.upper()
        p.add_argument(flag, dest=name, default=argparse.SUPPRESS,
                       help=f"{fields[name].description} [env {env}, default "
                            f"{fields[name].default}]")
    p.add_argument("--env-file", default=argparse.SUPPRESS,
                   help="read MEGACACHE_* settings from this file")


def load_settings(args: argparse.Namespace) -> Settings:
    values = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    env_file = getattr(args, "env_file", None)
    return Settings(_env_file=env_file, **values)  # type: ignore[call-arg]


def serve(settings: Settings) -> None:
    import uvicorn

    _export(settings)
    if settings.workers > 1:
        _metrics_dir(settings)
    print(
        f"megacache-server: http://{settings.host}:{settings.port}  data={settings.data_dir}  "
        f"index={settings.index_url()}  workers={settings.workers}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        "megacache_server.app:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_level=settings.log_level,
        access_log=settings.log_format != "json",  # JSON mode logs requests itself
        timeout_keep_alive=settings.keepalive_timeout_s,  # type: ignore[arg-type]
        http=_http_protocol(),
        h11_max_incomplete_event_size=int(settings.max_header_size) + 16 * 1024,
    )


def _http_protocol() -> str:
    """Our header-bounding protocol (megacache_server.protocol) when httptools is installed;
    else h11, whose incomplete-event limit bounds header bytes while reading."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "megacache_server.protocol:BoundedHttpToolsProtocol"


def _metrics_dir(settings: Settings) -> None:
    """Several workers share Prometheus counters through files in a fresh directory."""
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or
                settings.data_dir.resolve() / ".metrics" / str(settings.port))
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)


def _export(settings: Settings) -> None:
    """Hand the merged settings to uvicorn worker processes."""
    for name, value in settings.model_dump(exclude_none=True).items():
        os.environ["MEGACACHE_" + name.upper()] = str(value)
    data_dir = settings.data_dir.resolve()
    os.environ["MEGACACHE_DATA_DIR"] = str(data_dir)
    os.environ["MEGACACHE_INDEX"] = settings.index or f"sqlite:///{data_dir / 'index.sqlite3'}"


@contextlib.asynccontextmanager
async def opened_cache(settings: Settings) -> AsyncIterator[Cache]:
    """The cache service over the configured storage, for a maintenance command."""
    storage = build_storage(settings)
    await storage.open()
    try:
        yield Cache(storage)
    finally:
        await storage.close()


async def run_gc(settings: Settings, *, dry_run: bool) -> int:
    async with opened_cache(settings) as cache:
        gc_plan = await cache.gc_plan()
        print(f"stored {gc_plan.stored_bytes} bytes; budget "
              f"{gc_plan.budget if gc_plan.budget is not None else 'none'}; "
              f"{gc_plan.kept_in_grace} unreferenced blob(s) within the "
              f"{settings.gc_grace_s:.0f}s grace period kept")
        for key, why in gc_plan.evict:
            print(f"evict entry {key}  {why}")
        for digest, size, why, _ in gc_plan.delete:
            print(f"delete blob {digest}  {size} bytes  {why}")
        if dry_run:
            print(f"dry run: would evict {len(gc_plan.evict)} entries and delete "
                  f"{len(gc_plan.delete)} blobs ({gc_plan.freed_bytes} bytes)")
            return 0
        done = await cache.collect(gc_plan=gc_plan)
        if done is None:
            print("megacache-server: another collector holds the GC lock; try again later",
                  file=sys.stderr)
            return 1
        print(f"evicted {done.evicted} entries, deleted {done.deleted} blobs "
              f"({done.freed_bytes} bytes), spared {done.spared}")
        return 0


async def run_fsck(settings: Settings, *, repair: bool, verify: bool) -> int:
    async with opened_cache(settings) as cache:
        report = await cache.check(repair=repair, verify=verify)
    for line in report.lines():
        print(line)
    return 0 if report.clean or repair else 1


async def manage_tokens(settings: Settings, args: argparse.Namespace) -> int:
    async with opened_cache(settings) as cache:
        if args.token_command == "create":
            scopes = tuple(s.strip() for s in args.scopes.split(",") if s.strip())
            try:
                lifetime = parse_duration(args.expires) if args.expires else None
                token, record = new_token(args.name, scopes, args.namespace, lifetime)
            except ValueError as exc:
                print(f"megacache-server: {exc}", file=sys.stderr)
                return 2
            await cache.add_token(record)
            print(token)
            print(f"created token {record.token_id} for {record.name!r}: scopes "
                  f"{','.join(record.scopes)}, namespace {record.namespace!r}, expires "
                  f"{_when(record.expires_at)} (shown once; only its hash is stored)",
                  file=sys.stderr)
            return 0
        if args.token_command == "list":
            now = time.time()
            for t in await cache.tokens():
                state = "revoked" if t.revoked else "expired" if t.expired(now) else \
                    f"active until {_when(t.expires_at)}"
                print(f"{t.token_id}  {t.name:<24} {','.join(t.scopes):<16} "
                      f"{t.namespace:<16} {state}")
            return 0
        if not await cache.revoke_token(args.token_id):
            print(f"megacache-server: no token {args.token_id}", file=sys.stderr)
            return 1
        print(f"revoked {args.token_id}")
        return 0


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "never"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def signing_key(args: argparse.Namespace) -> int:
    """`signing-key generate|public`: the server keeps the private key, clients the public."""
    try:
        if args.key_command == "generate":
            public = write_new_key(args.out)
            print(f"wrote private key {args.out} (mode 0600): set "
                  f"MEGACACHE_SIGNING_KEY_FILE={args.out} on the server; give clients "
                  "MEGACACHE_VERIFY_KEY=<the line on stdout>", file=sys.stderr)
        else:
            public = signer_for(args.key_file).public_key
    except FileExistsError:
        print(f"megacache-server: {args.out} exists; not overwriting a key", file=sys.stderr)
        return 1
    except (OSError, SigningError) as exc:
        print(f"megacache-server: {exc}", file=sys.stderr)
        return 1
    print(public)
    return 0


async def set_pinned(settings: Settings, key: str, pinned: bool) -> int:
    async with opened_cache(settings) as cache:
        if not is_hex64(key):
            print(f"megacache-server: no entry {key}", file=sys.stderr)
            return 1
        await cache.bound(ANONYMOUS).set_pinned(key, pinned)
        print(f"{'pinned' if pinned else 'unpinned'} {key}")
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        print(f"megacache-server: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if args.command == "signing-key":
        return signing_key(args)
    if args.command in (None, "serve"):
        problem = settings.exposure_problem()
        if problem:
            print(f"megacache-server: {problem}", file=sys.stderr)
            return 2
        serve(settings)
        return 0
    try:
        if args.command == "gc":
            return asyncio.run(run_gc(settings, dry_run=args.dry_run))
        if args.command == "fsck":
            return asyncio.run(run_fsck(settings, repair=args.repair, verify=args.verify))
        if args.command == "token":
            return asyncio.run(manage_tokens(settings, args))
        return asyncio.run(set_pinned(settings, args.key, args.command == "pin"))
    except ApiError as exc:
        print(f"megacache-server: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
