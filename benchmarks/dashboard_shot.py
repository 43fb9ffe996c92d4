"""Seed a server with a week of realistic runs and photograph its dashboard.

    python -m benchmarks dashboard_shot            # writes benchmarks/results/dashboard.png

The README's screenshot comes from here; the dashboard test uses the same seeding and the
same headless Chromium calls to check the page shows what the API says.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx

from benchmarks.harness.servers import LocalServer
from megacache_client.wire.manifest import BlobRef, Fingerprint, Manifest

ROOT = Path(__file__).resolve().parent
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
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(["--window-size=1400,1300", f"--screenshot={path}", url], profile)
    if not path.exists():
        raise RuntimeError(f"chromium wrote no screenshot to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "dashboard.png")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="megacache-dash-"))
    with LocalServer(work / "data") as server:
        seed(server.url)
        screenshot(server.url + "/", args.out, work / "chromium")
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
