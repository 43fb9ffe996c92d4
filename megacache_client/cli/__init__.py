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
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megacache_client import __version__
from megacache_client.cli import jobs as cli_jobs
from megacache_client.config import ClientConfig, ConfigError
from megacache_client.transport.breaker import CircuitBreaker
from megacache_client.transport.client import RemoteCache, TransportError
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire import exitcodes
from megacache_client.wire.escape import escape
from megacache_client.wire.events import REPLAYS
from megacache_client.wire.exitcodes import ExitCode
from megacache_client.wire.manifest import Fingerprint, is_hex64


class ProgressBar:
    """A transfer progress line on stderr: redrawn in place at most 10 times a second on a
    terminal; elsewhere (a log file, a CI step) one line at each quarter, never a `\r`."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started = time.monotonic()
        self._last = 0.0
        self._tty = sys.stderr.isatty()
        self._quarter = -1

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        frac = done / total if total else 1.0
        if self._tty:
            if now - self._last < 0.1 and done < total:
                return
        elif int(frac * 4) <= self._quarter and done < total:
            return
        self._last, self._quarter = now, int(frac * 4)
        rate = done / max(now - self.started, 1e-6)
        scale, unit = byte_unit(total)
        line = (f"{self.label:<24} [{'#' * int(frac * 30):<30}] {frac:6.1%} "
                f"{done / scale:8.1f}/{total / scale:.1f} {unit} "
                f"{rate / byte_unit(rate)[0]:7.1f} {byte_unit(rate)[1]}/s")
        if self._tty:
            sys.stderr.write(f"\r{line}{chr(10) if done >= total else ''}")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _size(n: float) -> str:
    scale, unit = byte_unit(n)
    return f"{n / scale:.1f} {unit}"


def byte_unit(n: float) -> tuple[float, str]:
    """The decimal unit a byte count reads best in (B, kB, MB, GB): a 40 kB blob is not
    "0.0 MB"."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return scale, unit
    return 1.0, "B"


def _config(args: argparse.Namespace, **overrides: Any) -> ClientConfig:
    config = ClientConfig.from_env(url=args.url, token=args.token, **overrides)
    if not config.url:
        raise ConfigError("no server: pass --url or set MEGACACHE_URL")
    return config


def _remote(config: ClientConfig) -> RemoteCache:
    """A command's own breaker: one typed by a person is not held back by the node's (a
    server that was down for the training ranks a minute ago may be fixed by now)."""
    return RemoteCache(config, CircuitBreaker())


def _torch_problem() -> str:
    """Why this environment's torch cannot use the cache ("" when it can)."""
    from megacache_client.torch import supported

    return supported.problem()


def _here(args: argparse.Namespace, config: ClientConfig) -> Fingerprint:
    options = {"mode": args.compile_mode} if args.compile_mode else None
    return _as_a_trainer(config, options)


def _as_a_trainer(config: ClientConfig, options: dict[str, Any] | None = None) -> Fingerprint:
    """The key a trainer with these settings computes. Precompiled Dynamo (on by default) is
    part of the config component, so it is switched on here as `enable` does: a key computed
    without it would never be a trainer's (its push only ever a fallback)."""
    from megacache_client.steps.fingerprint import compute
    from megacache_client.torch import precompile

    precompile.turn_on(config)
    return compute(namespace=config.namespace, options=options, model=config.model,
                   code=config.code)


def cmd_fingerprint(args: argparse.Namespace) -> int:
    if why := _torch_problem():
        raise ConfigError(f"{why}: a job here would not use the cache")
    config = ClientConfig.from_env(model=args.model, code=args.code)  # no server needed
    fp = _here(args, config)
    out: dict[str, Any] = {"key": fp.key(), **fp.to_dict()}
    if config.code is None:
        out["code_note"] = AUTOMATIC_CODE
    print(json.dumps(out, indent=2))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """What a job with this fingerprint would load here, and what that could save; with
    nothing to load, what was missed and why, and no saving claimed. Exit 0 when a job
    would load an entry, 1 when it would compile cold."""
    from megacache_client.results import LoadResult
    from megacache_client.steps.fetch import find_entry

    config = _config(args, model=args.model, code=args.code)
    if why := _torch_problem():
        return _explained({"outcome": "inert", "reason": why}, args.json)
    fp = _here(args, config)
    result = LoadResult()
    with _remote(config) as remote:
        found = find_entry(remote, fp, result, config.fallback)
    report: dict[str, Any] = {"key": fp.key(), "model": fp.model, "code": fp.code,
                              "outcome": result.outcome, "reason": result.reason,
                              "differing": result.differing}
    if config.code is None:
        report["code"] = "automatic"
        report["code_note"] = AUTOMATIC_CODE
        if result.outcome == "fallback" and result.differing == ["code"]:
            # the trainer's key is not this one: its code is its model's source hash, which
            # only the trainer computes; an entry that differs in code alone is what it finds
            report["outcome"] = "hit or fallback"
            report["reason"] = ("the newest entry of this model, env and hw: an exact hit "
                                "for a trainer whose model source is the entry's, else "
                                "loaded as a fallback")
    if found is not None:
        m = found.manifest
        report["entry"] = {"key": m.key, "torch": m.torch_version, "code": m.fingerprint.code,
                           "artifacts": m.artifact_counts, "cold_compile_s": m.cold_compile_s,
                           "created_at": m.created_at.isoformat()}
    return _explained(report, args.json)


AUTOMATIC_CODE = ("automatic: the trainer hashes its compiled model's source, which this "
                  "command cannot see; give --code (or MEGACACHE_CODE) for a trainer's exact key")


def _explained(report: dict[str, Any], as_json: bool) -> int:
    loads = report["outcome"] in ("hit", "fallback", "hit or fallback")
    if as_json:
        print(json.dumps(report, indent=2))
        return 0 if loads else 1
    if "key" in report:
        print(f"fingerprint  {report['key']} (model {report['model']!r}, code "
              f"{report['code']!r})")
        if "code_note" in report:
            print(f"code         {report['code_note']}")
    print(f"lookup       {report['outcome']}: {report['reason']}")
    entry = report.get("entry")
    if loads and entry is not None:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(entry["artifacts"].items()))
        print(f"entry        {entry['key'][:16]} (code {entry['code']!r}, torch "
              f"{entry['torch']}, {counts or 'no artifact counts'})")
        print(f"could save   up to {entry['cold_compile_s']:.1f} s of torch compile (the "
              "entry's cold compile), for the graphs torch finds in it; the run's event "
              "says how many it used (replay full/partial/rebuilt)")
    else:
        print("could save   nothing: a job here loads nothing from megacache and compiles "
              "cold")
    return 0 if loads else 1


def cmd_ls(args: argparse.Namespace) -> int:
    with _remote(_config(args)) as remote:
        entries = remote.list_entries(model=args.model, limit=args.limit)
    if args.json:
        print(json.dumps([json.loads(m.to_json()) for m in entries], indent=2))
        return 0
    rows = [(m.key[:16], m.fingerprint.model, m.fingerprint.code[:20], m.torch_version,
             _size(sum(b.size for b in m.blobs)), f"{m.cold_compile_s:.1f}",
             m.created_at.strftime("%Y-%m-%d %H:%M")) for m in entries]
    _table(("key", "model", "code", "torch", "size", "cold s", "created"), rows)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _remote(_config(args)) as remote:
        found = remote.get_entry(_key(remote, args.key))
    if found is None:
        print(f"megacache: no entry {args.key}", file=sys.stderr)
        return 1
    print(json.dumps(json.loads(found.manifest.to_json()), indent=2))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    config = _config(args)
    node = NodeCache(config.node_cache_dir, config.lock_timeout_s)
    with _remote(config) as remote:
        found = remote.get_entry(_key(remote, args.key))
        if found is None:
            print(f"megacache: no entry {args.key}", file=sys.stderr)
            return 1
        for blob in found.manifest.blobs:
            download = functools.partial(remote.download_blob, blob.digest, blob.size,
                                         progress=ProgressBar(f"{blob.role} {blob.digest[:8]}"))
            path, got = node.fetch(blob.digest, blob.size, download)
            print(f"{blob.role:<10} {path}  ({'downloaded' if got else 'already on node'})")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from megacache_client.steps.shipping import build_manifest, bundle_blob, upload_blobs

    config = _config(args, model=args.model, code=args.code)
    node = NodeCache(config.node_cache_dir, config.lock_timeout_s)
    fp = _as_a_trainer(config)
    raw = args.bundle.read_bytes()
    blob = bundle_blob(node, raw)
    manifest = build_manifest(fp, [blob], {}, args.cold_compile_s)
    with _remote(config) as remote:
        sent = upload_blobs(remote, node, [blob], ProgressBar("megacache"))
        etag = remote.put_entry(manifest)
    print(f"pushed {manifest.key} ({sent} bytes uploaded, etag {etag})")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _remote(_config(args)) as remote:
        stats = remote.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    rows = []
    for m in stats["models"]:
        o = m["outcomes"]
        rows.append((m["model"], m["runs"], o["hit"], o["fallback"], o["miss"],
                     o["invalid"] + o["error"] + o["inert"], f"{m['hit_rate']:.0%}",
                     *_job_cells(m), f"{m['saved_s'] / 3600:.2f}",
                     f"{m['bytes_down'] / 1e6:.0f}"))
    t = stats["total"]
    rows.append(("TOTAL", t["runs"], "", "", "", "", f"{t['hit_rate']:.0%}", *_job_cells(t),
                 f"{t['saved_hours']:.2f}", f"{t['bytes_down'] / 1e6:.0f}"))
    _table(("model", "runs", "hit", "fallback", "miss", "failed", "hit rate",
            "replayed full/part/rebuilt", "start p50 s", "recover p50 s", "restarts",
            "hours saved", "MB down"), rows)
    return 0


def _job_cells(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """Replays, and the job figures (from a server that reports them; else blanks)."""
    replays = row.get("replays") or {}
    replayed = "/".join(str(replays.get(k, 0)) for k in REPLAYS)

    def seconds(name: str) -> str:
        value = row.get(name)
        return cli_jobs.seconds(value) if isinstance(value, (int, float)) else "-"

    return replayed, seconds("tts_p50_s"), seconds("ttr_p50_s"), str(row.get("restarts", "-"))


def cmd_jobs(args: argparse.Namespace) -> int:
    with _remote(_config(args)) as remote:
        if args.trend:
            found: Any = remote.ett_trend(days=args.days, period=args.period,
                                          **({"model": args.model} if args.model else {}))
        else:
            found = remote.job_ett(args.job) if args.job else remote.jobs(limit=args.limit)
    if args.json:
        print(json.dumps(found, indent=2))
    elif args.trend:
        cli_jobs.trend_tables(found, _table)
    elif args.job:
        cli_jobs.job_tables(found, _table)
    else:
        cli_jobs.jobs_table(found, _table)
    return 0


def cmd_autoload(args: argparse.Namespace) -> int:
    source = Path(__file__).resolve().parents[2] / "megacache_autoload.pth"
    if not source.exists():
        raise ConfigError(f"{source} is missing: reinstall megacache (the wheel ships it)")
    text = source.read_text()
    target = Path(args.target or sysconfig.get_paths()["purelib"]) / "megacache_autoload.pth"
    if args.action == "install":
        target.write_text(text)
        print(f"installed {target}: processes with MEGACACHE_URL set now use the cache")
    else:
        target.unlink(missing_ok=True)
        print(f"removed {target}")
    return 0


class UsageError(ValueError):
    """An argument argparse could not check itself (exit 2, like argparse's own errors)."""


class NotFound(LookupError):
    """What the command was asked about is not there (exit 1)."""


MIN_PREFIX = 4
PREFIX_SCAN = 1000
"""Entries a key prefix is looked up among (the newest; the most one listing returns)."""


def _key(remote: RemoteCache, value: str) -> str:
    """The entry key `value` names: a whole key, or a unique prefix of one as `ls` prints
    it. A prefix is looked up among the namespace's newest PREFIX_SCAN entries."""
    if is_hex64(value):
        return value
    if not (MIN_PREFIX <= len(value) < 64 and all(c in "0123456789abcdef" for c in value)):
        raise UsageError(f"a key is 64 lowercase hex characters, or a unique prefix of one "
                         f"(at least {MIN_PREFIX}, as `megacache ls` prints it), not {value!r}")
    matches = sorted({m.key for m in remote.list_entries(limit=PREFIX_SCAN)
                      if m.key.startswith(value)})
    if len(matches) > 1:
        raise UsageError(f"key prefix {value} is ambiguous: {len(matches)} entries start "
                         "with it:\n  " + "\n  ".join(matches) + "\ngive more of the key")
    if not matches:
        raise NotFound(f"no entry whose key starts with {value} among the newest "
                       f"{PREFIX_SCAN} (`megacache ls --json` prints whole keys)")
    return matches[0]


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
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
