"""`megacache-server`: run the service, and the maintenance commands beside it.

This module is the command line itself: the parser and the dispatch. Each command is one
`cmd_*` function named by its parser entry (`set_defaults(fn=...)`), in a module per command
group: `serve` (the service in the foreground), `housekeeping` (gc, fsck, pin, unpin),
`tokens` (token create, list, revoke) and `signing_key`. How they run (settings, storage,
failures as exit codes) is `runner`; the flags made of the settings are `flags`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from megacache_server import __version__
from megacache_server.cli.flags import (
    EPILOG,
    INDEX_FLAGS,
    SERVE_FLAGS,
    STORAGE_FLAGS,
    add_flags,
)
from megacache_server.cli.housekeeping import cmd_fsck, cmd_gc, cmd_pin
from megacache_server.cli.runner import CommandFailed
from megacache_server.cli.serve import cmd_serve
from megacache_server.cli.signing_key import cmd_key_generate, cmd_key_public
from megacache_server.cli.tokens import cmd_token_create, cmd_token_list, cmd_token_revoke
from megacache_server.service.housekeeping.collector import GC_NICE


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: each command names its `cmd_*` function (`fn`), which `main`
    calls."""
    parser = argparse.ArgumentParser(
        prog="megacache-server", epilog=EPILOG,
        description="Remote compile cache for PyTorch 2 (content-addressed Mega-Cache bundles). "
                    "Without a command: serve.")
    parser.add_argument("--version", action="version", version=f"megacache-server {__version__}")
    add_flags(parser, SERVE_FLAGS)
    parser.set_defaults(fn=cmd_serve)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_p = sub.add_parser("serve", help="run the HTTP service (the default)", epilog=EPILOG)
    add_flags(serve_p, SERVE_FLAGS)
    serve_p.set_defaults(fn=cmd_serve)
    gc = sub.add_parser("gc", help="evict over-budget entries, collect unreferenced blobs")
    gc.add_argument("--dry-run", action="store_true", help="show what would go; change nothing")
    gc.add_argument("--json", action="store_true",
                    help="collect and print one JSON line of what went (the server runs its "
                         "GC this way)")
    gc.add_argument("--nice", type=int, default=0, metavar="N",
                    help="lower this process's CPU priority by N first (the server's GC: "
                         f"{GC_NICE}), so the service it runs beside gets the CPU first")
    add_flags(gc, (*STORAGE_FLAGS, "store_budget"))
    gc.set_defaults(fn=cmd_gc)
    fsck_p = sub.add_parser("fsck", help="check index and blob store agree (exit 1 on problems)")
    fsck_p.add_argument("--repair", action="store_true",
                        help="drop dangling entries and stale records, record orphan blobs")
    fsck_p.add_argument("--verify", action="store_true", help="also re-hash every blob")
    add_flags(fsck_p, STORAGE_FLAGS)
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
    add_flags(create, INDEX_FLAGS)
    create.set_defaults(fn=cmd_token_create)
    listing = tsub.add_parser("list", help="list tokens (never their secrets)")
    add_flags(listing, INDEX_FLAGS)
    listing.set_defaults(fn=cmd_token_list)
    revoke = tsub.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("token_id")
    add_flags(revoke, INDEX_FLAGS)
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
        add_flags(p, INDEX_FLAGS)
        p.set_defaults(fn=cmd_pin, pinned=name == "pin")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (a `CommandFailed` said on stderr, not raised)."""
    args = build_parser().parse_args(argv)  # a bad command line exits 2 (USAGE) here
    try:
        return int(args.fn(args))
    except CommandFailed as exc:
        print(f"megacache-server: {exc}", file=sys.stderr)
        return int(exc.code)


if __name__ == "__main__":
    sys.exit(main())
