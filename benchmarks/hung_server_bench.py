"""What a hung cache server (accepts connections, never answers) costs the ranks of a node.

    python benchmarks/hung_server_bench.py [--ranks 4] [--out benchmarks/results/hung.json]

Two scenarios side by side, in one run, against the same hung server, default timeouts
(connect 3 s, read 30 s, 2 retries):

- `no deadline, own breaker`: how the client behaved before the load deadline and the
  node-shared breaker (emulated: a deadline of an hour, a node cache dir per rank);
- `deadline + node breaker`: the defaults (10 s deadline, one breaker file per node).

Each scenario starts `--ranks` processes at once, then as many again once the first wave is
done (ranks that start late, or a second job on the node). Each process only runs the load
step (`Session.load()`), and reports the seconds it waited on the server (load time minus the
fingerprint, which is local work). Prints a table, writes JSON and its RESULTS.md section.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from results_md import write_section

RANK = """
import json, sys
import megacache_client
from megacache_client.config import ClientConfig
from megacache_client.lifecycle import Session
session = Session(ClientConfig.from_env())
r = session.load()
print(json.dumps({"outcome": r.outcome, "reason": r.reason,
                  "waited_s": r.seconds - r.steps.get("fingerprint", 0.0)}))
"""

SCENARIOS = {
    "no deadline, own breaker": {"MEGACACHE_LOAD_DEADLINE_S": "3600", "own_node": "1"},
    "deadline + node breaker": {},
}


def run_rank(url: str, node: Path, extra: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    env.update({"MEGACACHE_URL": url, "MEGACACHE_NODE_CACHE_DIR": str(node),
                "MEGACACHE_MODEL": "hung-bench", "MEGACACHE_CODE": "v1"})
    env.update({k: v for k, v in extra.items() if k.startswith("MEGACACHE_")})
    out = subprocess.run([sys.executable, "-c", RANK], env=env, capture_output=True,
                         text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"outcome": "crashed", "reason": out.stderr[-500:], "waited_s": float("nan")}
    return dict(json.loads(lines[-1]))


def scenario(url: str, root: Path, name: str, extra: dict[str, str], ranks: int
             ) -> list[dict[str, object]]:
    rows = []
    for wave in (1, 2):
        def one(i: int, wave: int = wave) -> dict[str, object]:
            node = root / (f"node-{wave}-{i}" if extra.get("own_node") else "node")
            return {"scenario": name, "wave": wave, "rank": i,
                    **run_rank(url, node, extra)}

        with ThreadPoolExecutor(ranks) as pool:
            rows += list(pool.map(one, range(ranks)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "hung.json")
    parser.add_argument("--no-results-md", action="store_true")
    args = parser.parse_args()

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)  # accepts connections, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(SCENARIOS)) as pool:
        futures = [pool.submit(scenario, url, Path(tmp) / str(n), name, extra, args.ranks)
                   for n, (name, extra) in enumerate(SCENARIOS.items())]
        rows = [row for f in futures for row in f.result()]
    listener.close()

    summary = []
    for name in SCENARIOS:
        for wave in (1, 2):
            waits = [float(r["waited_s"]) for r in rows  # type: ignore[arg-type]
                     if r["scenario"] == name and r["wave"] == wave]
            outcomes = sorted({str(r["outcome"]) for r in rows
                               if r["scenario"] == name and r["wave"] == wave})
            summary.append({"scenario": name, "wave": wave, "ranks": len(waits),
                            "median_wait_s": round(statistics.median(waits), 2),
                            "max_wait_s": round(max(waits), 2), "outcomes": outcomes})
    header = "| scenario | wave | ranks | median wait s | max wait s | outcomes |"
    table = [header, "|---|---|---|---|---|---|"] + [
        f"| {s['scenario']} | {s['wave']} | {s['ranks']} | {s['median_wait_s']} | "
        f"{s['max_wait_s']} | {', '.join(s['outcomes'])} |" for s in summary]
    print("\n".join(table))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "ranks": rows,
                                    "wall_s": round(time.monotonic() - started, 1)}, indent=2))
    if not args.no_results_md:
        write_section("hung", "## Hung server: seconds each rank waits before compiling cold\n\n"
                      "`python benchmarks/hung_server_bench.py --ranks "
                      f"{args.ranks}`: a server that accepts connections and never answers; "
                      "default timeouts (read 30 s, 2 retries). Wave 2 starts after wave 1 "
                      "is done.\n\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
