"""Every rank warm: a job whose ranks compile different things against one whose ranks are
the same, cold, on new machines, and restarted after one rank is SIGKILLed.

    python -m benchmarks ranks_bench [--ranks 2] [--out benchmarks/results/ranks.json]

Each job is `torchrun --nproc-per-node RANKS stage_job.py` over gloo on this machine,
zero-code, default settings, every rank on a machine of its own (its own Inductor cache,
TMPDIR and node cache). `stages`: each rank compiles its own layers (rank 0 an embedding and
two linear layers, the others other layers and a head), as pipeline stages do; `same`:
every rank compiles rank 0's layers (data parallel). Per job kind, in order against one
server: cold (no entry), new machine (the entry from the cold job), and restart (a job whose
attempt 0 has its last rank SIGKILLed once its compile is published; attempt 1 on new
machines). Per rank: seconds from process start to the end of its first step, its first
step, FX graph and AOTAutograd misses, precompiled Dynamo hits, g++ builds, bytes down and
up; per job: the slowest rank's time to first step and the server's blob and entry PUTs.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import STAGE_JOB
from benchmarks.harness.machines import GxxCounter, clean_env
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer, free_port

HERE = Path(__file__).resolve().parent


def puts(url: str) -> dict[str, float]:
    """The server's PUTs so far, by route (blob, entry)."""
    import httpx

    out = {"blob": 0.0, "entry": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("megacache_http_requests_total{") and 'method="PUT"' in line:
            n = float(line.rsplit(" ", 1)[1])
            if 'route="/v1/cas/{digest}"' in line:
                out["blob"] += n
            elif 'route="/v1/ac/{key}"' in line:
                out["entry"] += n
    return out


def job(url: str, root: Path, model: str, ranks: int, stages: str, kill: bool
        ) -> dict[str, Any]:
    """One torchrun job; its per-rank results (of its last attempt) and PUTs."""
    results = root / "results"
    results.mkdir(parents=True)
    gxx = GxxCounter(root / "bin")
    env = clean_env() | gxx.env(root / "unused.log") | {
        "MEGACACHE_URL": url, "MEGACACHE_MODEL": model, "OMP_NUM_THREADS": "1",
        "RESULT_DIR": str(results), "MACHINES": str(root / "machines"), "STAGES": stages,
        # torchrun's agent and anything else not on a rank's machine: under this job's
        # root too (its torchelastic_* dirs, an Inductor cache), removed with it
        "TMPDIR": str(root / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
    (root / "tmp").mkdir(parents=True)
    if kill:
        env["KILL_RANK"] = str(ranks - 1)
    before = puts(url)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
         "--max-restarts", "1" if kill else "0", "--monitor-interval", "0.1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         "--rdzv-id", f"{model}-{time.monotonic_ns()}", str(STAGE_JOB)],
        env=env, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"job {model} failed:\n{done.stderr[-4000:]}")
    after = puts(url)
    attempt = 1 if kill else 0
    rows = []
    for rank in range(ranks):
        r = json.loads((results / f"rank{rank}-attempt{attempt}.json").read_text())
        log = root / "machines" / f"attempt{attempt}" / f"rank{rank}" / "gxx.log"
        rows.append({"rank": rank, "to_first_step_s": r["to_first_step_s"],
                     "first_step_s": r["first_step_s"],
                     "fx_miss": r["counters"]["fxgraph_miss"],
                     "aot_miss": r["counters"]["aot_miss"],
                     "fx_hit": r["counters"]["fxgraph_hit"],
                     "precompile_hit": r["precompile_hit"], "gxx": GxxCounter.builds(log),
                     "bytes_down": r["bytes_down"], "bytes_up": r["bytes_up"],
                     "outcome": r["outcome"]})
    return {"ranks": rows, "wall_s": round(wall, 1),
            "job_to_first_step_s": max(r["to_first_step_s"] for r in rows),
            "blob_puts": after["blob"] - before["blob"],
            "entry_puts": after["entry"] - before["entry"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 3, 4))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ranks.json")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"ranks": args.ranks, "jobs": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalServer(Path(tmp) / "data").start()
        try:
            for stages in ("stages", "same"):
                model = f"ranks-{stages}-{os.getpid()}"
                kind = "differ" if stages == "stages" else "same"
                for scenario, kill in (("cold", False), ("new machine", False),
                                       ("restart after SIGKILL", True)):
                    name = model if scenario != "restart after SIGKILL" else model + "-r"
                    root = Path(tmp) / f"{stages}-{scenario.replace(' ', '-')}"
                    got = job(server.url, root, name, args.ranks, kind, kill)
                    out["jobs"].append({"job": stages, "scenario": scenario, **got})
                    print(f"{stages:7} {scenario:22} job to first step "
                          f"{got['job_to_first_step_s']:.2f}s, PUTs blob "
                          f"{got['blob_puts']:.0f} entry {got['entry_puts']:.0f}",
                          file=sys.stderr)
        finally:
            server.stop()
    table = ["| job | scenario | rank | to end of step 1, s | first step, s | FX miss | "
             "AOT miss | FX hit | Dynamo hit | g++ builds | bytes down | bytes up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for j in out["jobs"]:
        for r in j["ranks"]:
            table.append(f"| {j['job']} | {j['scenario']} | {r['rank']} | "
                         f"{r['to_first_step_s']} | {r['first_step_s']} | {r['fx_miss']} | "
                         f"{r['aot_miss']} | {r['fx_hit']} | {r['precompile_hit']} | "
                         f"{r['gxx']} | {r['bytes_down']} | {r['bytes_up']} |")
    jobs = ["| job | scenario | job to end of step 1, s | blob PUTs | entry PUTs |",
            "|---|---|---|---|---|"] + [
        f"| {j['job']} | {j['scenario']} | {j['job_to_first_step_s']} | "
        f"{j['blob_puts']:.0f} | {j['entry_puts']:.0f} |" for j in out["jobs"]]
    print("\n".join(table) + "\n\n" + "\n".join(jobs))
    write_record(make_record("ranks_bench", given_argv(argv), out["jobs"], ranks=args.ranks),
                 args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
