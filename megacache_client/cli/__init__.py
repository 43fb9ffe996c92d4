"""`megacache`: the client from a terminal — inspect, pre-fetch and publish bundles.

    megacache fingerprint --model dlrm-v3 --code $GIT_SHA
    megacache explain --model dlrm-v3 --code $GIT_SHA   # what a job here would load
    megacache ls --model dlrm-v3
    megacache show KEY
    megacache pull KEY            # pre-fetch a node before the job starts
    megacache push bundle.bin --model dlrm-v3 --code $GIT_SHA --cold-compile-s 180
    megacache stats
    megacache jobs [JOB]          # where each job's time went (ETT), or one job's attempts
    megacache autoload install    # zero-code hook for this environment

Server URL and token come from --url/--token (before or after the subcommand) or
MEGACACHE_URL/MEGACACHE_TOKEN.

This module is the parser and the dispatch (and the exit codes); each command group is a
module of its own: `explain` (fingerprint, explain), `entries` (ls, show, pull, push),
`stats`, `jobs`, `autoload`; what they share is `common`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megacache_client import __version__
from megacache_client.cli.autoload import cmd_autoload
from megacache_client.cli.common import NotFound, UsageError
from megacache_client.cli.entries import cmd_ls, cmd_pull, cmd_push, cmd_show
from megacache_client.cli.explain import cmd_explain, cmd_fingerprint
from megacache_client.cli.jobs import cmd_jobs
from megacache_client.cli.stats import cmd_stats
from megacache_client.config import ConfigError
from megacache_client.errors import TransportError
from megacache_client.wire import exitcodes
from megacache_client.wire.escape import escape
from megacache_client.wire.exitcodes import ExitCode

MODEL_HELP = "model name in the fingerprint [MEGACACHE_MODEL] (default: derived from the " \
    "compiled module's class)"
CODE_HELP = "code version in the fingerprint, e.g. a git sha [MEGACACHE_CODE] (default: a " \
    "hash of the model's source)"
JSON_HELP = "print JSON instead of a table"
KEY_HELP = "the entry's 64-hex key, or a unique prefix of it as `ls` prints it"


def _global_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """--url/--token, accepted before the subcommand (`default` None) and after it
    (`default` SUPPRESS, so an absent option there does not undo one given before)."""
    parser.add_argument("--url", default=default, help="server URL [MEGACACHE_URL]")
    parser.add_argument("--token", default=default, help="bearer token [MEGACACHE_TOKEN]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megacache", description=__doc__.splitlines()[0],
                                     epilog=exitcodes.describe())
    parser.add_argument("--version", action="version", version=f"megacache {__version__}")
    _global_options(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    p = command("fingerprint", "print this environment's key and its components")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--code", help=CODE_HELP)
    p.add_argument("--compile-mode", help="torch.compile mode the job uses")
    p.set_defaults(fn=cmd_fingerprint)

    p = command("explain", "what a job here would load and could save, or why nothing "
                "(exit 1 when it would compile cold)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--code", help=CODE_HELP)
    p.add_argument("--compile-mode", help="torch.compile mode the job uses")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=cmd_explain)

    p = command("ls", "list entries, newest first")
    p.add_argument("--model", help="only entries of this model")
    p.add_argument("--limit", type=int, default=20, help="at most this many entries")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=cmd_ls)

    p = command("show", "print an entry's manifest")
    p.add_argument("key", help=KEY_HELP)
    p.set_defaults(fn=cmd_show)

    p = command("pull", "download an entry's blobs into the node cache")
    p.add_argument("key", help=KEY_HELP)
    p.set_defaults(fn=cmd_pull)

    p = command("push", "publish a Mega-Cache bundle file for this environment")
    p.add_argument("bundle", type=Path, help="bytes from torch.compiler.save_cache_artifacts()")
    p.add_argument("--model", required=True, help=MODEL_HELP.split(" (default")[0])
    p.add_argument("--code", required=True, help=CODE_HELP.split(" (default")[0])
    p.add_argument("--cold-compile-s", type=float, default=0.0,
                   help="seconds the bundle took to compile cold (for seconds-saved stats)")
    p.set_defaults(fn=cmd_push)

    p = command("stats", "runs, hit rate and compile time saved per model")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=cmd_stats)

    p = command("jobs", "where each job's wall time went: ETT %% and its split (docs/ett.md)")
    p.add_argument("job", nargs="?", help="one job's attempts instead")
    p.add_argument("--limit", type=int, default=50, help="at most this many jobs")
    p.add_argument("--trend", action="store_true",
                   help="the namespace's ETT per day (or hour) instead, and the jobs that "
                   "lost the most")
    p.add_argument("--days", type=float, default=30, help="with --trend: how far back")
    p.add_argument("--period", choices=("day", "hour"), default="day",
                   help="with --trend: per day or per hour (hourly: at most 8 days)")
    p.add_argument("--model", help="with --trend: one model only")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=cmd_jobs)

    p = command("autoload", "install or remove the zero-code .pth hook")
    p.add_argument("action", choices=("install", "remove"))
    p.add_argument("--target", help="site-packages directory (default: this environment's)")
    p.set_defaults(fn=cmd_autoload)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad command line exits 2 (USAGE) here
    try:
        return int(args.fn(args))
    except (UsageError, NotFound, ConfigError, TransportError, OSError) as exc:
        print(f"megacache: {escape(exc, 1000)}", file=sys.stderr)  # may quote a server
        return int(exit_code(exc))


def exit_code(exc: Exception) -> ExitCode:
    """The documented exit code of a failure (megacache_client.wire.exitcodes)."""
    if isinstance(exc, UsageError):
        return ExitCode.USAGE
    if isinstance(exc, ConfigError):
        return ExitCode.CONFIG
    if isinstance(exc, TransportError):
        return transport_exit_code(exc)
    return ExitCode.PROBLEM  # NotFound; OSError: a local file (the bundle, the node cache)


def transport_exit_code(exc: TransportError) -> ExitCode:
    """No answer, or a server that cannot serve now (5xx): UNAVAILABLE. A refused token
    (401, 403): CONFIG. Any other refusal (404, 413, ...): PROBLEM."""
    if exc.status is None or exc.status >= 500:
        return ExitCode.UNAVAILABLE
    if exc.status in (401, 403):
        return ExitCode.CONFIG
    return ExitCode.PROBLEM
