"""Load test: many concurrent clients doing what trainers do, then check nothing was lost.

    python -m benchmarks load_test                 # 200 clients, 60 s + 60 s, server here
    python -m benchmarks load_test --clients 20 --seconds 5     # the test suite's short run
    python -m benchmarks load_test --no-hostile    # the well-behaved clients alone

The mix per request: 70% entry lookups (job start: is there a bundle?), 20% blob
downloads, 10% new entries (upload a blob, then its manifest). Bounded in time and count,
loopback only. Afterwards every acknowledged write is read back and its bytes re-hashed.

Two phases of `--seconds` each, on one server: `calm` (the well-behaved tenant alone),
then `hostile`, where another tenant (its own token and namespace) runs
benchmarks/harness/hostile.py in its own process beside them: 150 MiB header lines, 1,100 idle
sockets against a server whose processes may open 512 descriptors each (1,024 for 2
workers), an event flood and non-finite manifests. The well-behaved clients must see no
error and lose no write; their latency is reported for both phases.
Prints a table and writes JSON (default benchmarks/results/load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import HOSTILE
from benchmarks.harness.benchlib import percentile
from benchmarks.harness.record import given_argv, make_record, write_record
from benchmarks.harness.servers import LocalServer
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest

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


GOOD_NAMESPACE, HOSTILE_NAMESPACE = "good-tenant", "hostile-tenant"


def manifest_for(data: bytes, code: str) -> Manifest:
    fp = Fingerprint(namespace=GOOD_NAMESPACE, model="load-test", code=code,
                     env={"torch": "2.13.0"}, hw={"arch": "x86_64"},
                     config={"mode": "default"})
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


@dataclass
class Tenants:
    """Bearer tokens of the two tenants (None: the server runs without auth)."""

    good: str | None = None
    hostile: str | None = None
    idle_sockets: int = 1100
    hostile_on: bool = True


def summary(tally: Tally, elapsed: float) -> dict[str, Any]:
    everything = [x for v in tally.latencies.values() for x in v]
    return {
        "seconds": round(elapsed, 2), "requests": tally.requests,
        "rps": round(tally.requests / elapsed, 1), "errors": sum(tally.errors.values()),
        "error_kinds": tally.errors, "writes_acknowledged": len(tally.written),
        "p50_ms": round(percentile(everything, 0.5) * 1000, 2),
        "p99_ms": round(percentile(everything, 0.99) * 1000, 2),
        "by_op": {op: {"count": len(v), "p50_ms": round(percentile(v, 0.5) * 1000, 2),
                       "p99_ms": round(percentile(v, 0.99) * 1000, 2)}
                  for op, v in sorted(tally.latencies.items())},
    }


async def run(url: str, clients: int, seconds: float, max_requests: int, seed_n: int,
              blob_size: int, upload_size: int, tenants: Tenants) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"authorization": f"Bearer {tenants.good}"} if tenants.good else {}
    phases: dict[str, Any] = {}
    total = Tally(max_requests=max_requests)
    hostile_result: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits,
                                 headers=headers) as client:
        seeded = await seed(client, seed_n, blob_size)
        for phase in ("calm", "hostile") if tenants.hostile_on else ("calm",):
            tally = Tally(max_requests=max_requests)
            started = time.monotonic()
            deadline = started + seconds
            print(f"[load] {phase}: {clients} clients for {seconds:g}s against {url}",
                  file=sys.stderr)
            work = [one_client(client, deadline, seeded, tally, upload_size,
                               random.Random(i)) for i in range(clients)]
            if phase == "hostile":
                work.append(hostile_process(url, tenants, seconds, hostile_result))
            await asyncio.gather(*work)
            phases[phase] = summary(tally, time.monotonic() - started)
            for op, values in tally.latencies.items():
                total.latencies.setdefault(op, []).extend(values)
            for kind, n in tally.errors.items():
                total.errors[kind] = total.errors.get(kind, 0) + n
            total.written += tally.written
        print(f"[load] {total.requests} requests; verifying {len(total.written)} writes",
              file=sys.stderr)
        problems = await verify(client, total.written)
    result = summary(total, sum(p["seconds"] for p in phases.values()))
    result.update(clients=clients, writes_lost_or_corrupt=problems, phases=phases)
    if tenants.hostile_on:
        result["hostile"] = hostile_result
    return result


async def hostile_process(url: str, tenants: Tenants, seconds: float,
                          into: dict[str, Any]) -> None:
    """benchmarks/harness/hostile.py in its own process: another tenant, not our event loop."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hostile.json"
        cmd = [sys.executable, str(HOSTILE), "--url", url, "--namespace",
               HOSTILE_NAMESPACE, "--seconds", str(seconds), "--idle-sockets",
               str(tenants.idle_sockets), "--out", str(out)]
        if tenants.hostile:
            cmd += ["--token", tenants.hostile]
        proc = await asyncio.create_subprocess_exec(*cmd)
        if await proc.wait() != 0:
            raise RuntimeError(f"the hostile tenant's process failed ({proc.returncode})")
        into.update(json.loads(out.read_text()))


def make_token(data_dir: Path, namespace: str) -> str:
    out = subprocess.run([sys.executable, "-m", "megacache_server", "token", "create",
                          "--name", namespace, "--scopes", "read,write", "--namespace",
                          namespace, "--data-dir", str(data_dir)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def limit_descriptors(pid: int, soft: int) -> None:
    """Lower the descriptor limit of a server process and its workers (as a small container
    would have it), so idle sockets would exhaust it if nothing bounded them."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    pids = [pid, *(int(p) for p in children.read_text().split())] if children.exists() \
        else [pid]
    for p in pids:  # the hard limit too: the server raises its soft limit up to the hard
        resource.prlimit(p, resource.RLIMIT_NOFILE, (soft, soft))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing server (default: start one here)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60, help="length of each phase")
    parser.add_argument("--max-requests", type=int, default=2_000_000)
    parser.add_argument("--workers", type=int, default=2, help="workers of the started server")
    parser.add_argument("--seed-entries", type=int, default=20)
    parser.add_argument("--blob-size", type=int, default=256 * 1024)
    parser.add_argument("--upload-size", type=int, default=64 * 1024)
    parser.add_argument("--no-hostile", action="store_true", help="skip the hostile phase")
    parser.add_argument("--idle-sockets", type=int, default=1100)
    parser.add_argument("--server-nofile", type=int, default=512,
                        help="descriptor limit of each started server process (512 x 2 "
                             "workers: 1,024, below the 1,100 idle sockets)")
    parser.add_argument("--good-token", help="with --url: the well-behaved tenant's token")
    parser.add_argument("--hostile-token", help="with --url: the hostile tenant's token")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "load.json")
    args = parser.parse_args(argv)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # our own sockets: raise ours
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    server = None
    url = args.url
    tenants = Tenants(args.good_token, args.hostile_token, args.idle_sockets,
                      not args.no_hostile)
    if url is None:
        data_dir = Path(tempfile.mkdtemp(prefix="megacache-load-")) / "data"
        server = LocalServer(data_dir, "--auth", "--workers", str(args.workers)).start()
        url = server.url
        tenants.good = make_token(data_dir, GOOD_NAMESPACE)
        tenants.hostile = make_token(data_dir, HOSTILE_NAMESPACE)
        assert server.proc is not None
        limit_descriptors(server.proc.pid, args.server_nofile)
    try:
        result = asyncio.run(run(url, args.clients, args.seconds, args.max_requests,
                                 args.seed_entries, args.blob_size, args.upload_size,
                                 tenants))
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.data_dir.parent, ignore_errors=True)  # its store and log
    result["server_workers"] = args.workers if server is not None else None
    result["server_nofile"] = args.server_nofile if server is not None else None
    print_table(result)
    write_record(make_record("load_test", given_argv(argv), [result]), args.out, indent=2)
    return 0 if result["errors"] == 0 and not result["writes_lost_or_corrupt"] else 1


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'phase':>8} {'clients':>8} {'req/s':>8} {'requests':>9} {'errors':>7} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'writes':>7}")
    for name, p in result["phases"].items():
        print(f"{name:>8} {result['clients']:>8} {p['rps']:>8} {p['requests']:>9} "
              f"{p['errors']:>7} {p['p50_ms']:>8} {p['p99_ms']:>8} "
              f"{p['writes_acknowledged']:>7}")
    print(f"writes lost or corrupt: {len(result['writes_lost_or_corrupt'])}")
    for op, s in result["by_op"].items():
        print(f"  {op:<9} {s['count']:>7} requests  p50 {s['p50_ms']} ms  p99 {s['p99_ms']} ms")
    if "calm" in result["phases"] and "hostile" in result["phases"]:
        calm, hostile = result["phases"]["calm"], result["phases"]["hostile"]
        print(f"hostile / calm: p50 x{hostile['p50_ms'] / max(calm['p50_ms'], 1e-9):.2f}, "
              f"p99 x{hostile['p99_ms'] / max(calm['p99_ms'], 1e-9):.2f}, "
              f"req/s x{hostile['rps'] / max(calm['rps'], 1e-9):.2f}")
    if "hostile" in result:
        h = result["hostile"]
        print(f"hostile tenant: {h['idle_sockets']} idle sockets "
              f"({h['idle_closed_by_server']} closed by the server); most header bytes "
              f"one connection got out before the server cut it {h['header_bytes_sent_max']}"
              " (mostly kernel socket buffers)")
        for what, n in h["outcomes"].items():
            print(f"  {what:<40} {n:>7}")


if __name__ == "__main__":
    sys.exit(main())
