"""The hostile tenant of the load test: what one client with a write token (or none) throws
at a shared server while other tenants work (issue 11).

Four kinds of abuse run at once, each bounded by the deadline and loopback only:
- oversized headers: a request whose header line would be 150 MiB, streamed;
- idle sockets: `idle` connections that never send a byte, reopened when closed;
- an event flood: events as fast as one connection can post them, with huge counters;
- non-finite manifests: entries whose fingerprint holds NaN / Infinity.
The tally counts what the server answered; the well-behaved clients are counted elsewhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest

HUGE_HEADER = 150 * 1024 * 1024
CHUNK = 64 * 1024


@dataclass
class HostileTally:
    outcomes: dict[str, int] = field(default_factory=dict)
    header_bytes_sent_max: int = 0
    idle_closed_by_server: int = 0

    def count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1


async def oversized_headers(host: str, port: int, deadline: float, tally: HostileTally) -> None:
    """Stream a 150 MiB header line; note how much the server took before it stopped us."""
    while time.monotonic() < deadline:
        sent, status = 0, "closed"
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            chunk = b"a" * CHUNK
            while sent < HUGE_HEADER and time.monotonic() < deadline:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), timeout=10)
                sent += CHUNK
                if reader.at_eof() or writer.is_closing():
                    break
            if sent < HUGE_HEADER and time.monotonic() >= deadline and not (
                    reader.at_eof() or writer.is_closing()):
                # the run ended mid-line, before the server stopped us: no verdict to count
                # (the server would answer 408 once the half-sent header goes stale)
                status = "unfinished at the end of the run"
            else:
                line = await asyncio.wait_for(reader.readline(), timeout=10)
                status = line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "closed"
            writer.close()
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        tally.header_bytes_sent_max = max(tally.header_bytes_sent_max, sent)
        tally.count(f"oversized header: {status}")
        await asyncio.sleep(0.05)


async def idle_socket(host: str, port: int, deadline: float, tally: HostileTally) -> None:
    """One connection that never sends anything; opened again whenever the server drops it."""
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            tally.count("idle socket: connect failed")
            await asyncio.sleep(0.2)
            continue
        try:
            data = await asyncio.wait_for(reader.read(1), timeout=max(0.01, deadline -
                                                                     time.monotonic()))
            if data == b"":
                tally.idle_closed_by_server += 1
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()
        await asyncio.sleep(0.05)


async def event_flood(client: httpx.AsyncClient, deadline: float, tally: HostileTally) -> None:
    """Events as fast as the server takes them, claiming 2**53 bytes and a month saved."""
    body = {"key": "0" * 64, "model": "flood", "outcome": "hit", "compile_s": 0.0,
            "saved_s": 30 * 24 * 3600.0, "bytes_down": 2**53, "bytes_up": 2**53}
    while time.monotonic() < deadline:
        try:
            r = await client.post("/v1/events", json=body)
            tally.count(f"event: {r.status_code}")
        except httpx.HTTPError as exc:
            tally.count(f"event: {type(exc).__name__}")


def nonfinite_body(data: bytes, namespace: str, n: int) -> tuple[str, bytes]:
    """A manifest whose fingerprint config holds NaN, Infinity or -Infinity, as raw JSON (a
    client library would write null), keyed as the server computes keys."""
    token = ("NaN", "Infinity", "-Infinity")[n % 3]
    fp = Fingerprint(namespace=namespace, model="poison", code=f"p{n}",
                     config={"lr": 0.5})  # the client refuses NaN itself: swapped in below
    digest = hashlib.sha256(data).hexdigest()
    m = Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0", cold_compile_s=1.0,
                 blobs=[BlobRef(digest=digest, size=len(data), role="megacache",
                                compression="none")],
                 created_at=datetime.now(timezone.utc))
    return m.key, m.to_json().replace(b'"lr":0.5', b'"lr":' + token.encode())


def surrogate_key_body(data: bytes, namespace: str, n: int) -> tuple[str, bytes]:
    """A manifest whose config, env, hw, producer or blob meta holds a key that is a lone
    surrogate (a JSON `\\ud800` escape): issue 58's 500 with a traceback, now a 422."""
    import json

    key, body = nonfinite_body(data, namespace, n)
    doc = json.loads(body.replace(b"NaN", b"0.5").replace(b"-Infinity", b"0.5")
                     .replace(b"Infinity", b"0.5"))
    node = (doc["fingerprint"]["config"], doc["fingerprint"]["env"], doc["fingerprint"]["hw"],
            doc.setdefault("producer", {}), doc["blobs"][0].setdefault("meta", {}))[n % 5]
    node["__K__"] = "1"
    return key, json.dumps(doc).replace('"__K__"', '"k\\ud800"').encode()


async def nonfinite_manifests(client: httpx.AsyncClient, namespace: str, deadline: float,
                              tally: HostileTally) -> None:
    """Manifests with non-finite numbers and, every other one, a key that is not text."""
    data = os.urandom(1024)
    digest = hashlib.sha256(data).hexdigest()
    n = 0
    while time.monotonic() < deadline:
        kind = "non-finite manifest" if n % 2 == 0 else "surrogate-key manifest"
        try:
            await client.put(f"/v1/cas/{digest}", content=data)
            key, body = (nonfinite_body if n % 2 == 0 else surrogate_key_body)(
                data, namespace, n // 2)
            r = await client.put(f"/v1/ac/{key}", content=body,
                                 headers={"content-type": "application/json"})
            tally.count(f"{kind}: {r.status_code}")
        except httpx.HTTPError as exc:
            tally.count(f"{kind}: {type(exc).__name__}")
        n += 1
        await asyncio.sleep(0.02)


async def run_hostile(url: str, token: str | None, namespace: str, deadline: float,
                      idle: int, tally: HostileTally) -> None:
    """Every kind of abuse at once until the deadline."""
    host, port = httpx.URL(url).host, httpx.URL(url).port or 80
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        tasks: list[Any] = [oversized_headers(host, port, deadline, tally),
                            event_flood(client, deadline, tally),
                            nonfinite_manifests(client, namespace, deadline, tally)]
        tasks += [idle_socket(host, port, deadline, tally) for _ in range(idle)]
        await asyncio.gather(*tasks)


def main(argv: list[str] | None = None) -> int:
    """Run as its own process (the load test does), so the abuse does not share an event
    loop with the well-behaved clients it is measured against."""
    import argparse
    import json
    import resource
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token")
    parser.add_argument("--namespace", default="hostile-tenant")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--idle-sockets", type=int, default=1100)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    tally = HostileTally()
    deadline = time.monotonic() + args.seconds
    asyncio.run(run_hostile(args.url, args.token, args.namespace, deadline,
                            args.idle_sockets, tally))
    args.out.write_text(json.dumps({"outcomes": dict(sorted(tally.outcomes.items())),
                                    "header_bytes_sent_max":
                                        tally.header_bytes_sent_max,
                                    "idle_closed_by_server": tally.idle_closed_by_server,
                                    "idle_sockets": args.idle_sockets}))
    print(f"[hostile] done: {sum(tally.outcomes.values())} attacks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
