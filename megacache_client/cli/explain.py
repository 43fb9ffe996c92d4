"""`megacache fingerprint` and `megacache explain`: the key a trainer here computes, and what
a job with it would load and could save (or why nothing). Both compute the key as a trainer
does (`common.as_a_trainer`); neither loads anything, so a person can ask before a job runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from megacache_client.cli.common import as_a_trainer, config, remote, torch_problem
from megacache_client.config import ClientConfig, ConfigError
from megacache_client.wire.manifest import Fingerprint

AUTOMATIC_CODE = ("automatic: the trainer hashes its compiled model's source, which this "
                  "command cannot see; give --code (or MEGACACHE_CODE) for a trainer's exact key")


def _here(args: argparse.Namespace, config: ClientConfig) -> Fingerprint:
    options = {"mode": args.compile_mode} if args.compile_mode else None
    return as_a_trainer(config, options)


def cmd_fingerprint(args: argparse.Namespace) -> int:
    if why := torch_problem():
        raise ConfigError(f"{why}: a job here would not use the cache")
    settings = ClientConfig.from_env(model=args.model, code=args.code)  # no server needed
    fp = _here(args, settings)
    out: dict[str, Any] = {"key": fp.key(), **fp.to_dict()}
    if settings.code is None:
        out["code_note"] = AUTOMATIC_CODE
    print(json.dumps(out, indent=2))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """What a job with this fingerprint would load here, and what that could save; with
    nothing to load, what was missed and why, and no saving claimed. Exit 0 when a job
    would load an entry, 1 when it would compile cold."""
    from megacache_client.results import LoadResult
    from megacache_client.steps.fetch import find_entry

    settings = config(args, model=args.model, code=args.code)
    if why := torch_problem():
        return _explained({"outcome": "inert", "reason": why}, args.json)
    fp = _here(args, settings)
    result = LoadResult()
    with remote(settings) as server:
        found = find_entry(server, fp, result, settings.fallback)
    report: dict[str, Any] = {"key": fp.key(), "model": fp.model, "code": fp.code,
                              "outcome": result.outcome, "reason": result.reason,
                              "differing": result.differing}
    if settings.code is None:
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
