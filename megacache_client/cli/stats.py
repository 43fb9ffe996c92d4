"""`megacache stats`: runs, hit rate, replays and compile time saved per model, from the
server's events; with a server that reports them, each model's time to start and to
recover. The cache's figures; where a job's whole time went is `megacache jobs`
(`jobs.py`), whose way of printing seconds this shares.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from megacache_client.cli import jobs as cli_jobs
from megacache_client.cli.common import config, remote, table
from megacache_client.wire.events import REPLAYS


def cmd_stats(args: argparse.Namespace) -> int:
    with remote(config(args)) as server:
        stats = server.stats()
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
    table(("model", "runs", "hit", "fallback", "miss", "failed", "hit rate",
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
