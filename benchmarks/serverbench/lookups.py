"""The entry lookup job: latency of GET /v1/ac/{key} under concurrent clients, with wrk.

wrk is closed-loop (each connection sends its next request as soon as the last answer is
in) and reports its latency histogram through the Lua `done` hook below as one JSON line.
The references are the same server's /healthz (no storage: the framework's floor) and
nginx serving the manifest's bytes as a static file.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.benchlib import log, median

from .measure import Bench, settle
from .services import Service

LOOKUP_CLIENTS = 32

WRK_REPORT = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "bytes": %d, "duration_us": %d, "errors": %d, ' ..
    '"non_2xx": %d, "p50_us": %d, "p99_us": %d, "max_us": %d}\\n',
    summary.requests, summary.bytes, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""


@dataclass
class Latency:
    requests_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    errors: int
    server_cores: float


def wrk_latency(url: str, clients: int, duration: float, script: Path,
                server: Service) -> Latency:
    """wrk's closed-loop latency: `clients` connections, each sending its next request as
    soon as the last answer is in, over 2 threads (one per core)."""
    cmd = ["wrk", f"-t{min(2, clients)}", f"-c{clients}", f"-d{duration:g}s", "--timeout", "5s",
           "-s", str(script), url]
    cpu0 = server.cpu_seconds()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60, check=True)
    server_cpu = server.cpu_seconds() - cpu0
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no report:\n{out.stdout}\n{out.stderr}")
    r = json.loads(line.removeprefix("WRKJSON "))
    seconds = r["duration_us"] / 1e6
    return Latency(requests_s=round(r["requests"] / seconds, 1),
                   p50_ms=r["p50_us"] / 1000, p99_ms=r["p99_us"] / 1000,
                   max_ms=r["max_us"] / 1000, errors=r["errors"] + r["non_2xx"],
                   server_cores=round(server_cpu / seconds, 2))


def run_lookups(bench: Bench, urls: dict[str, tuple[str, Service]], clients: int
                ) -> list[dict[str, Any]]:
    """Entry lookup latency under `clients` concurrent clients, repeats interleaved."""
    script = bench.root / "wrk_report.lua"
    script.write_text(WRK_REPORT)
    runs: dict[str, list[Latency]] = {name: [] for name in urls}
    for url, service in urls.values():  # warm-up
        wrk_latency(url, clients, min(1.0, bench.duration), script, service)
    for r, name in bench.interleaved(list(urls)):
        url, service = urls[name]
        lat = wrk_latency(url, clients, bench.duration, script, service)
        runs[name].append(lat)
        log(f"lookup x{clients} {name:<5} repeat {r + 1}: {lat.requests_s:8.0f} req/s, p50 "
            f"{lat.p50_ms:.2f} ms, p99 {lat.p99_ms:.2f} ms, server {lat.server_cores:.2f} cores"
            + (f", {lat.errors} ERRORS" if lat.errors else ""))
        settle(service for _, service in urls.values())
    return [{"target": name, "clients": clients,
             "requests_s": round(median([x.requests_s for x in lats]), 1),
             "p50_ms": round(median([x.p50_ms for x in lats]), 2),
             "p99_ms": round(median([x.p99_ms for x in lats]), 2),
             "errors": sum(x.errors for x in lats),
             "runs": [asdict(x) for x in lats]} for name, lats in runs.items()]
