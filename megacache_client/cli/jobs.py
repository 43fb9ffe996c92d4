"""`megacache jobs`: where each job's wall time went, why its attempts failed, where its
starts and recoveries went, and the namespace over time (`--trend`), as tables.

The server answers (`GET /v1/jobs`, `/v1/jobs/{job}/ett`, `/v1/ett/trend`); this fetches
and draws them. Seconds are shown to a tenth, and under a second in milliseconds: a 0.047 s
checkpoint save is `47ms`, never a bare `0.0`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from megacache_client.cli.common import config, remote, table

SPLIT = (("training", "train"), ("data_wait", "data wait"), ("startup", "start"),
         ("compile", "compile"),
         ("checkpoint_save", "ckpt save"), ("checkpoint_restore", "restore"),
         ("lost_progress", "lost"), ("recovery", "recover"), ("idle", "idle"))
REPORT = (("time_to_start_s", "time to start s"), ("time_to_recover_s", "time to recover s"),
          ("checkpoint_save_s", "ckpt save s"), ("unsaved_training_s", "unsaved training s"))
"""A job's figures in the ETT report's words (the server's `ett.report_figures`)."""
PARTS = (("allocation_wait", "alloc"), ("restart_wait", "restart"), ("imports", "imports"),
         ("distributed", "dist"), ("model_build", "model"), ("checkpoint_restore", "restore"),
         ("first_batch", "batch"), ("compile", "compile"), ("first_step", "step"),
         ("other", "other"))
"""The components of a start or a recovery (the server's `ett_components`), short."""


def cmd_jobs(args: argparse.Namespace) -> int:
    with remote(config(args)) as server:
        if args.trend:
            found: Any = server.ett_trend(days=args.days, period=args.period,
                                          **({"model": args.model} if args.model else {}))
        else:
            found = server.job_ett(args.job) if args.job else server.jobs(limit=args.limit)
    if args.json:
        print(json.dumps(found, indent=2))
    elif args.trend:
        trend_tables(found)
    elif args.job:
        job_tables(found)
    else:
        jobs_table(found)
    return 0


def jobs_table(found: list[dict[str, Any]]) -> None:
    """The jobs that reported last: ETT%, the report's figures, failures and their causes."""
    rows = [(j["job_id"], j["ett"].get("model") or "-", tenths(j["ett"]["ett_pct"]),
             seconds(j["ett"]["wall_s"]), *(seconds(j["ett"].get(k)) for k, _ in REPORT),
             j["ett"]["failures"], causes(j["ett"].get("failures_by_cause")))
            for j in found if j.get("ett")]
    table(("job", "model", "ETT %", "wall s", *(head for _, head in REPORT), "failures",
           "causes"), rows)


def job_tables(found: dict[str, Any]) -> None:
    """One job: each attempt's split and how it ended; why the failed ones failed; where
    each start and recovery went, by component."""
    rows = [(a["attempt"], tenths(a["ett_pct"]), *split(a["seconds"]),
             seconds(a["time_to_start_s"]), seconds(a["time_to_recover_s"]),
             f"failed:{a.get('cause') or 'unknown'}" if a["failed"]
             else "live" if a["live"] else a["ended"] or "-")
            for a in found["attempts"]]
    rows.append(("TOTAL", tenths(found["ett_pct"]), *split(found["seconds"]),
                 seconds(found["time_to_start_s"]), seconds(found["time_to_recover_s"]),
                 f"{found['failures']} failed"))
    table(("attempt", "ETT %", *(short + " s" for _, short in SPLIT),
           "time to start s", "time to recover s", "state"), rows)
    failed = [a for a in found["attempts"] if a["failed"]]
    if failed:
        print()
        table(("attempt", "cause", "why", "unsaved training s"),
              [(a["attempt"], a.get("cause") or "unknown", a.get("cause_detail") or "-",
                seconds(a.get("lost_s"))) for a in failed])
    bars = [a for a in found["attempts"] if a.get("components")]
    if bars:
        print()
        table(("attempt", "of", *(short + " s" for _, short in PARTS), "groups"),
              [(a["attempt"], "start" if a["time_to_start_s"] is not None else "recover",
                *(seconds(a["components"]["seconds"].get(name)) for name, _ in PARTS),
                a["components"]["process_groups"]) for a in bars])


def trend_tables(found: dict[str, Any]) -> None:
    """The namespace per day (or hour): ETT%, lost and recovery seconds, failures by cause,
    time to start and to recover; then the jobs that lost the most."""
    fmt = "%Y-%m-%d" if found["period"] == "day" else "%Y-%m-%d %H:00"
    rows = [(time.strftime(fmt, time.gmtime(p["start"])), tenths(p["ett_pct"]),
             seconds(p["wall_s"]), seconds(p["seconds"]["lost_progress"]),
             seconds(p["seconds"]["recovery"]), p["failures"],
             causes(p["failures_by_cause"]),
             _pair(p["time_to_start"]), _pair(p["time_to_recover"]))
            for p in found["series"] if p["wall_s"] or p["failures"]]
    rows.append(("TOTAL", tenths(found["ett_pct"]), seconds(found["wall_s"]),
                 seconds(found["seconds"]["lost_progress"]),
                 seconds(found["seconds"]["recovery"]), found["failures"],
                 causes(found["failures_by_cause"]), _pair(found["time_to_start"]),
                 _pair(found["time_to_recover"])))
    table((found["period"] + " (UTC)", "ETT %", "wall s", "lost s", "recover s", "failures",
           "causes", "start p50/p90 s", "recover p50/p90 s"), rows)
    if found["top_lost"]:
        print()
        table(("job", "model", "lost s", "last seen (UTC)"),
              [(j["job_id"], j["model"] or "-", seconds(j["lost_s"]),
                time.strftime("%Y-%m-%d %H:%M", time.gmtime(j["last_seen"])))
               for j in found["top_lost"]])


def _pair(quantiles: dict[str, Any]) -> str:
    if not quantiles["n"]:
        return "-"
    return f"{seconds(quantiles['p50_s'])}/{seconds(quantiles['p90_s'])}"


def causes(rows: list[dict[str, Any]] | None) -> str:
    """Failures by cause, as `oom:2,preempted:1` ("-": none)."""
    return ",".join(f"{r['cause']}:{r['failures']}" for r in rows or []) or "-"


def tenths(value: float | None) -> str:
    """A percentage to a tenth; "-" when there is none."""
    return f"{value:.1f}" if value is not None else "-"


def seconds(value: float | None) -> str:
    """Seconds to a tenth, under a second in milliseconds (a 0.047 s save is `47ms`, never
    a bare 0.0); "-" when there is none."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if value < 0.001:
        return "<1ms"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}"


def split(by_category: dict[str, float]) -> list[str]:
    return [seconds(by_category.get(name, 0.0)) for name, _ in SPLIT]
