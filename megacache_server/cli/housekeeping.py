"""`megacache-server gc`, `fsck`, `pin` and `unpin`: what the store keeps, run on the
configured storage through the cache service (`runner.on_storage`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from megacache_client.wire.exitcodes import ExitCode
from megacache_client.wire.manifest import is_hex64
from megacache_server.cli.runner import CommandFailed, on_storage
from megacache_server.service.caching.cache import Cache
from megacache_server.service.security.auth import ANONYMOUS


@on_storage
async def cmd_gc(cache: Cache, args: argparse.Namespace) -> int:
    """`gc`: a report for a person, or one JSON line for the server that runs it as a child
    (`--json`), at a lower CPU priority when asked (`--nice`)."""
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
    """`fsck`: PROBLEM (1) when index and blob store disagree, unless it repaired them."""
    report = await cache.check(repair=args.repair, verify=args.verify)
    for line in report.lines():
        print(line)
    return ExitCode.OK if report.clean or args.repair else ExitCode.PROBLEM


@on_storage
async def cmd_pin(cache: Cache, args: argparse.Namespace) -> int:
    """`pin` and `unpin` (`args.pinned`): as the operator, who sees every namespace."""
    if not is_hex64(args.key):
        raise CommandFailed(ExitCode.PROBLEM, f"no entry {args.key}")
    await cache.bound(ANONYMOUS).set_pinned(args.key, args.pinned)
    print(f"{'pinned' if args.pinned else 'unpinned'} {args.key}")
    return ExitCode.OK
