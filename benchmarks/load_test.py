"""Load test: many concurrent clients doing what trainers do, then check nothing was lost.

    python benchmarks/load_test.py                 # 200 clients, 60 s, server started here
    python benchmarks/load_test.py --clients 20 --seconds 5     # the test suite's short run

The mix per request: 70% entry lookups (job start: is there a bundle?), 20% blob
downloads, 10% new entries (upload a blob, then its manifest). Bounded in time and count,
loopback only. Afterwards every acknowledged write is read back and its bytes re-hashed.
Prints a table and writes JSON (default benchmarks/results/load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from benchlib import percentile  # benchmarks/benchlib.py, next to this script

from megacache_client.manifest import BlobRef, Fingerprint, Manifest
from megacache_server.local import LocalServer

ROOT = Path(__file__).resolve().parent


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    written: list[tuple[str, str, bytes]] = field(default_factory=list)  # key, digest, data
    max_requests: int = 10**9

    def record(self, op: str, seconds: float, ok: bool, detail: str = "") -> None:
        self.latencies.setdefault(op, []).append(seconds)
        if not ok:
            name = f"{op}: {detail}"[:120]
            self.errors[name] = self.errors.get(name, 0) + 1

    @property
    def requests(self) -> int:
        return sum(len(v) for v in self.latencies.values())


def manifest_for(data: bytes, code: str) -> Manifest:
    fp = Fingerprint(model="load-test", code=code, env={"torch": "2.13.0"},
                     hw={"arch": "x86_64"}, config={"mode": "default"})
    digest = hashlib.sha256(data).hexdigest()
    return Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0", cold_compile_s=10.0,
                    blobs=[BlobRef(digest=digest, size=len(data), role="megacache",
                                   compression="none")],
                    created_at=datetime.now(timezone.utc))


async def seed(client: httpx.AsyncClient, n: int, size: int) -> list[tuple[str, str, bytes]]:
    """Entries that exist before the load starts, for lookups and downloads to hit."""
    seeded = []
    for i in range(n):
        data = os.urandom(size)
        m = manifest_for(data, f"seed-{i}-{time.time_ns()}")
        digest = m.blobs[0].digest
        (await client.put(f"/v1/cas/{digest}", content=data)).raise_for_status()
        (await client.put(f"/v1/ac/{m.key}", content=m.to_json())).raise_for_status()
        seeded.append((m.key, digest, data))
    return seeded


async def one_client(client: httpx.AsyncClient, deadline: float, seeded: list[Any],
                     tally: Tally, upload_size: int, rng: random.Random) -> None:
    while time.monotonic() < deadline and tally.requests < tally.max_requests:
        roll = rng.random()
        key, digest, _ = rng.choice(seeded)
        started = time.monotonic()
        try:
            if roll < 0.7:
                op = "lookup"
                r = await client.get(f"/v1/ac/{key}")
                ok, detail = r.status_code == 200, str(r.status_code)
            elif roll < 0.9:
                op = "download"
                r = await client.get(f"/v1/cas/{digest}")
                ok, detail = r.status_code == 200, str(r.status_code)
            else:
                op = "publish"
                data = rng.randbytes(upload_size)
                m = manifest_for(data, f"w-{rng.getrandbits(64):x}")
                r = await client.put(f"/v1/cas/{m.blobs[0].digest}", content=data)
                ok, detail = r.status_code in (200, 201), f"blob {r.status_code}"
                if ok:
                    r = await client.put(f"/v1/ac/{m.key}", content=m.to_json())
                    ok, detail = r.status_code in (200, 201), f"entry {r.status_code}"
                    if ok:
                        tally.written.append((m.key, m.blobs[0].digest, data))
        except httpx.HTTPError as exc:
            ok, detail = False, type(exc).__name__
        tally.record(op, time.monotonic() - started, ok, detail)


async def verify(client: httpx.AsyncClient, written: list[tuple[str, str, bytes]]) -> list[str]:
    """Every acknowledged write must read back intact."""
    problems = []
    for key, digest, data in written:
        r = await client.get(f"/v1/ac/{key}")
        if r.status_code != 200 or r.json()["blobs"][0]["digest"] != digest:
            problems.append(f"entry {key[:12]}: {r.status_code}")
            continue
        blob = await client.get(f"/v1/cas/{digest}")
        if blob.status_code != 200 or hashlib.sha256(blob.content).hexdigest() != digest \
                or blob.content != data:
            problems.append(f"blob {digest[:12]}: {blob.status_code}")
    return problems


async def run(url: str, clients: int, seconds: float, max_requests: int, seed_n: int,
              blob_size: int, upload_size: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        seeded = await seed(client, seed_n, blob_size)
        tally = Tally(max_requests=max_requests)
        started = time.monotonic()
        deadline = started + seconds
        print(f"[load] {clients} clients for {seconds:g}s against {url}", file=sys.stderr)
        await asyncio.gather(*(one_client(client, deadline, seeded, tally, upload_size,
                                          random.Random(i)) for i in range(clients)))
        elapsed = time.monotonic() - started
        print(f"[load] {tally.requests} requests; verifying {len(tally.written)} writes",
              file=sys.stderr)
        problems = await verify(client, tally.written)
    everything = [x for v in tally.latencies.values() for x in v]
    return {
        "clients": clients, "seconds": round(elapsed, 2), "requests": tally.requests,
        "rps": round(tally.requests / elapsed, 1), "errors": sum(tally.errors.values()),
        "error_kinds": tally.errors, "writes_acknowledged": len(tally.written),
        "writes_lost_or_corrupt": problems,
        "p50_ms": round(percentile(everything, 0.5) * 1000, 2),
        "p99_ms": round(percentile(everything, 0.99) * 1000, 2),
        "by_op": {op: {"count": len(v), "p50_ms": round(percentile(v, 0.5) * 1000, 2),
                       "p99_ms": round(percentile(v, 0.99) * 1000, 2)}
                  for op, v in sorted(tally.latencies.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing server (default: start one here)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-requests", type=int, default=2_000_000)
    parser.add_argument("--workers", type=int, default=2, help="workers of the started server")
    parser.add_argument("--seed-entries", type=int, default=20)
    parser.add_argument("--blob-size", type=int, default=256 * 1024)
    parser.add_argument("--upload-size", type=int, default=64 * 1024)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "load.json")
    args = parser.parse_args(argv)

    server = None
    url = args.url
    if url is None:
        data_dir = Path(tempfile.mkdtemp(prefix="megacache-load-")) / "data"
        server = LocalServer(data_dir, "--workers", str(args.workers)).start()
        url = server.url
    try:
        result = asyncio.run(run(url, args.clients, args.seconds, args.max_requests,
                                 args.seed_entries, args.blob_size, args.upload_size))
    finally:
        if server is not None:
            server.stop()
    result["server_workers"] = args.workers if server is not None else None
    print(f"\n{'clients':>8} {'req/s':>8} {'requests':>9} {'errors':>7} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'writes':>7} {'lost':>5}")
    print(f"{result['clients']:>8} {result['rps']:>8} {result['requests']:>9} "
          f"{result['errors']:>7} {result['p50_ms']:>8} {result['p99_ms']:>8} "
          f"{result['writes_acknowledged']:>7} {len(result['writes_lost_or_corrupt']):>5}")
    for op, s in result["by_op"].items():
        print(f"  {op:<9} {s['count']:>7} requests  p50 {s['p50_ms']} ms  p99 {s['p99_ms']} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["errors"] == 0 and not result["writes_lost_or_corrupt"] else 1


if __name__ == "__main__":
    sys.exit(main())
