"""Seed a server with a week of realistic runs and photograph its dashboard.

    python -m benchmarks dashboard_shot            # writes benchmarks/results/dashboard.png

The README's screenshot is taken by the suite's browser test
(`tests/test_observability.py::test_dashboard_shows_what_the_api_says`, which checks the
page shows what the API says): this command runs that test, asking it to keep its
screenshot. The PNG records a digest of the dashboard's static files it was taken of
(`static_digest`, a tEXt chunk), and a fast test fails when the committed one is stale.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import struct
import subprocess
import sys
import time
import zlib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx

import megacache_server.api
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest

ROOT = Path(__file__).resolve().parent
SHOT = ROOT / "results" / "dashboard.png"
STATIC = Path(megacache_server.api.__file__).resolve().parent / "static"
"""The dashboard's own files: the page the screenshot shows."""
DIGEST_KEY = b"megacache-dashboard-static-sha256"
"""The PNG tEXt keyword under which a screenshot records `static_digest()`."""
SHOT_ENV = "MEGACACHE_DASHBOARD_SHOT"
"""Set to a path, the suite's browser test keeps its screenshot there."""
BROWSER_TEST = "tests/test_observability.py::test_dashboard_shows_what_the_api_says"
REGENERATE = "python -m benchmarks dashboard_shot"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-background-networking", "--disable-quic", "--no-first-run",
                  "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=8000"]
REASONS = {
    "miss": "no entry for this fingerprint; the newest entry of the model differs in env "
            "(torch: '2.12.0' vs '2.13.0')",
    "invalid": "blob 3fa1c9… is corrupt: got 1048576 bytes hashing to 77e0…",
    "error": "TransportError: get entry: ConnectTimeout",
}


REPLAY_OF = {"hit": "full", "fallback": "partial", "miss": "rebuilt"}


def seed(url: str, seed_value: int = 7, headers: dict[str, str] | None = None) -> None:
    """Entries for three models and an event every three hours for a week."""
    rng = random.Random(seed_value)
    with httpx.Client(base_url=url, headers=headers or {}, timeout=30) as c:
        for model, n in (("dlrm-v3", 3), ("llama-7b", 2), ("vit-b16", 1)):
            for i in range(n):
                data = rng.randbytes(rng.randint(1, 5) * 1_000_000)
                fp = Fingerprint(model=model, code=f"git-{i:07x}", env={"torch": "2.13.0"},
                                 hw={"gpu": "NVIDIA H100", "cc": "9.0"}, config={})
                digest = hashlib.sha256(data).hexdigest()
                c.put(f"/v1/cas/{digest}", content=data).raise_for_status()
                m = Manifest(key=fp.key(), fingerprint=fp, torch_version="2.13.0",
                             cold_compile_s=180.0, blobs=[BlobRef(
                                 digest=digest, size=len(data), role="megacache",
                                 compression="none")])
                c.put(f"/v1/ac/{m.key}", content=m.to_json()).raise_for_status()
        now = datetime.now(timezone.utc)
        for h in range(0, 168, 3):
            for model in ("dlrm-v3", "llama-7b", "vit-b16"):
                outcome = rng.choices(["hit", "fallback", "miss", "invalid", "error"],
                                      [6, 2, 2, 0.3, 0.3])[0]
                warm = outcome in ("hit", "fallback")
                event = {"key": "a" * 64, "model": model, "outcome": outcome,
                         "compile_s": 9.0 if warm else 180.0, "cold_compile_s": 180.0,
                         "saved_s": round(rng.uniform(140, 171), 1) if warm else 0.0,
                         "reason": REASONS.get(outcome, "exact fingerprint"),
                         "tts_s": round(rng.uniform(20, 40) if warm else rng.uniform(150, 200),
                                        1),
                         "created_at": (now - timedelta(hours=h)).isoformat(),
                         # every six hours a job starts, and three hours later restarts
                         "job_id": f"{model}-{h // 6}", "attempt": 1 - h % 6 // 3,
                         "rank": 0, "world_size": 1}
                if outcome in REPLAY_OF:  # the run said how much of the entry it replayed
                    event["replay"] = REPLAY_OF[outcome]
                c.post("/v1/events", json=event).raise_for_status()
        seed_ett(c, now.timestamp(), rng)


def seed_ett(c: httpx.Client, now: float, rng: random.Random) -> None:
    """The same jobs' progress (ETT): attempt 0 trains, saves hourly and dies; attempt 1
    starts three hours later, restores and runs to its end (the newest jobs still live)."""
    for k in range(28):
        for model in ("dlrm-v3", "llama-7b", "vit-b16"):
            t0 = now - (6 * k + 3) * 3600
            save = rng.uniform(8, 30)
            first = [{"kind": "start", "at": t0, "allocation_start": t0 - rng.uniform(20, 90)},
                     {"kind": "training", "at": t0 + rng.uniform(60, 200), "phases": [
                         {"phase": "imports", "at": t0 + 1, "seconds": rng.uniform(5, 12)},
                         {"phase": "distributed", "at": t0 + 15, "seconds": 4.0, "count": 2},
                         {"phase": "model_build", "at": t0 + 20, "seconds": rng.uniform(5, 20)},
                         {"phase": "first_batch", "at": t0 + 45, "seconds": 2.0}]},
                     *({"kind": "checkpoint_save", "at": t0 + h * 3600, "step": 1000 * h,
                        "blocking_s": save} for h in (1, 2)),
                     {"kind": "heartbeat", "at": t0 + 2.6 * 3600, "step": 2600}]
            t1 = t0 + 3 * 3600
            second = [{"kind": "start", "at": t1},
                      {"kind": "checkpoint_load", "at": t1 + 40, "blocking_s": 25.0,
                       "step": 2000},
                      {"kind": "training", "at": t1 + rng.uniform(70, 160)},
                      *({"kind": "checkpoint_save", "at": t1 + h * 3600, "step": 2000 + 1000 * h,
                         "blocking_s": save} for h in (1, 2)),
                      {"kind": "end", "at": t1 + 2.9 * 3600, "reason": "finished"}]
            runs: tuple[list[dict[str, Any]], ...] = (first, second)
            for attempt, records in enumerate(runs):
                sent = [r for r in records if float(r["at"]) < now - 1]  # the newest still run
                if sent:
                    c.post(f"/v1/jobs/{model}-{k}/progress", json={
                        "attempt": attempt, "records": sent, "model": model}
                           ).raise_for_status()


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def dump_dom(url: str, profile: Path) -> str:
    """The page's DOM after its scripts ran."""
    return _run(["--dump-dom", url], profile).stdout


def screenshot(url: str, path: Path, profile: Path) -> None:
    """The page at `url` as a PNG at `path`, stamped with the static files' digest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    _run(["--window-size=1400,1300", f"--screenshot={path}", url], profile)
    if not path.exists():
        raise RuntimeError(f"chromium wrote no screenshot to {path}")
    stamp(path, static_digest())


def static_digest() -> str:
    """sha256 over the dashboard's static files (names and bytes): what a screenshot shows."""
    h = hashlib.sha256()
    for path in sorted(p for p in STATIC.rglob("*") if p.is_file()):
        name = path.relative_to(STATIC).as_posix().encode()
        h.update(struct.pack(">I", len(name)) + name)
        data = path.read_bytes()
        h.update(struct.pack(">Q", len(data)) + data)
    return h.hexdigest()


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of each chunk of a PNG file."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    out, i = [], 8
    while i < len(png):
        (n,), kind = struct.unpack(">I", png[i:i + 4]), png[i + 4:i + 8]
        out.append((kind, png[i + 8:i + 8 + n]))
        i += 12 + n
    return out


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + \
        struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def stamp(path: Path, digest: str) -> None:
    """Record `digest` in the PNG at `path` (a tEXt chunk after the header, any earlier
    stamp replaced)."""
    chunks = [(k, d) for k, d in _chunks(path.read_bytes())
              if not (k == b"tEXt" and d.split(b"\0", 1)[0] == DIGEST_KEY)]
    chunks.insert(1, (b"tEXt", DIGEST_KEY + b"\0" + digest.encode()))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(k, d) for k, d in chunks))


def recorded_digest(path: Path) -> str | None:
    """The static files' digest a screenshot recorded, or None (taken before stamps)."""
    for kind, data in _chunks(path.read_bytes()):
        key, _, value = data.partition(b"\0")
        if kind == b"tEXt" and key == DIGEST_KEY:
            return value.decode()
    return None


def shot_wanted() -> Path | None:
    """Where the browser test keeps its screenshot (`SHOT_ENV`), or None: its temp dir."""
    value = os.environ.get(SHOT_ENV)
    return Path(value) if value else None


def wait_for_trend(url: str, timeout: float = 60.0) -> None:
    """Until the server's ETT roll has folded the seeded jobs into the trend (a server
    started with a short MEGACACHE_ETT_ROLL_S)."""
    deadline = time.monotonic() + timeout
    while not httpx.get(f"{url}/v1/ett/trend", timeout=10).json()["time_to_recover"]["n"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the ETT trend was not rolled")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SHOT)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    code = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p",
                           "no:cacheprovider", BROWSER_TEST],
                          cwd=ROOT.parent, env={**os.environ, SHOT_ENV: str(out)}).returncode
    if code == 0:
        print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
