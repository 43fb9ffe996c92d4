"""`megacache ls`, `show`, `pull` and `push`: the namespace's entries from a terminal.

Listing and showing read the index; pulling fills the node cache before a job starts (as
the trainer's own fetch would, through the gate, with a progress line); pushing publishes
a bundle file under the key a trainer here computes. An entry is named by its key or a
unique prefix of it, as `ls` prints it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

from megacache_client.cli.common import (
    NotFound,
    UsageError,
    as_a_trainer,
    byte_unit,
    config,
    remote,
    size,
    table,
)
from megacache_client.transport.client import RemoteCache
from megacache_client.transport.nodecache import NodeCache
from megacache_client.wire.manifest import is_hex64

MIN_PREFIX = 4
PREFIX_SCAN = 1000
"""Entries a key prefix is looked up among (the newest; the most one listing returns)."""


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


def cmd_ls(args: argparse.Namespace) -> int:
    with remote(config(args)) as server:
        entries = server.list_entries(model=args.model, limit=args.limit)
    if args.json:
        print(json.dumps([json.loads(m.to_json()) for m in entries], indent=2))
        return 0
    rows = [(m.key[:16], m.fingerprint.model, m.fingerprint.code[:20], m.torch_version,
             size(sum(b.size for b in m.blobs)), f"{m.cold_compile_s:.1f}",
             m.created_at.strftime("%Y-%m-%d %H:%M")) for m in entries]
    table(("key", "model", "code", "torch", "size", "cold s", "created"), rows)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with remote(config(args)) as server:
        found = server.get_entry(_key(server, args.key))
    if found is None:
        print(f"megacache: no entry {args.key}", file=sys.stderr)
        return 1
    print(json.dumps(json.loads(found.manifest.to_json()), indent=2))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    settings = config(args)
    node = NodeCache(settings.node_cache_dir, settings.lock_timeout_s)
    with remote(settings) as server:
        found = server.get_entry(_key(server, args.key))
        if found is None:
            print(f"megacache: no entry {args.key}", file=sys.stderr)
            return 1
        for blob in found.manifest.blobs:
            download = functools.partial(server.download_blob, blob.digest, blob.size,
                                         progress=ProgressBar(f"{blob.role} {blob.digest[:8]}"))
            path, got = node.fetch(blob.digest, blob.size, download)
            print(f"{blob.role:<10} {path}  ({'downloaded' if got else 'already on node'})")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from megacache_client.steps.shipping import build_manifest, bundle_blob, upload_blobs

    settings = config(args, model=args.model, code=args.code)
    node = NodeCache(settings.node_cache_dir, settings.lock_timeout_s)
    fp = as_a_trainer(settings)
    raw = args.bundle.read_bytes()
    blob = bundle_blob(node, raw)
    manifest = build_manifest(fp, [blob], {}, args.cold_compile_s)
    with remote(settings) as server:
        sent = upload_blobs(server, node, [blob], ProgressBar("megacache"))
        etag = server.put_entry(manifest)
    print(f"pushed {manifest.key} ({sent} bytes uploaded, etag {etag})")
    return 0


def _key(server: RemoteCache, value: str) -> str:
    """The entry key `value` names: a whole key, or a unique prefix of one as `ls` prints
    it. A prefix is looked up among the namespace's newest PREFIX_SCAN entries."""
    if is_hex64(value):
        return value
    if not (MIN_PREFIX <= len(value) < 64 and all(c in "0123456789abcdef" for c in value)):
        raise UsageError(f"a key is 64 lowercase hex characters, or a unique prefix of one "
                         f"(at least {MIN_PREFIX}, as `megacache ls` prints it), not {value!r}")
    matches = sorted({m.key for m in server.list_entries(limit=PREFIX_SCAN)
                      if m.key.startswith(value)})
    if len(matches) > 1:
        raise UsageError(f"key prefix {value} is ambiguous: {len(matches)} entries start "
                         "with it:\n  " + "\n  ".join(matches) + "\ngive more of the key")
    if not matches:
        raise NotFound(f"no entry whose key starts with {value} among the newest "
                       f"{PREFIX_SCAN} (`megacache ls --json` prints whole keys)")
    return matches[0]
