"""What every measurement of the server benchmark shares.

A `Tally` of what one measurement moved (bytes, responses, errors, client and server CPU),
the interleaved run order of repeats (`Bench.interleaved`), and `settle`, the wait for the
servers to go idle between measurements. Background load (other jobs on the same cores)
then hits every target alike, and the ratio of two targets within one run holds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.benchlib import log, median

from .services import Service

MB = 1e6  # throughput unit: MB/s = 10^6 bytes per second
SETTLE_S = 0.3  # pause after each measurement, then wait for the servers to go idle
SETTLE_MAX_S = 15.0
IDLE_CORES = 0.05


@dataclass
class Tally:
    """What one measurement moved; `seconds` is the wall time of the measured window."""

    bytes: int = 0
    responses: int = 0
    errors: int = 0
    seconds: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / MB if self.seconds else 0.0

    def record(self) -> dict[str, float | int]:
        return {**asdict(self), "mb_s": round(self.mb_s, 1),
                "client_cores": round(self.client_cpu_s / self.seconds, 2),
                "server_cores": round(self.server_cpu_s / self.seconds, 2)}

    def describe(self) -> str:
        """The server's cores and any errors, for the progress log."""
        return (f"server {self.server_cpu_s / self.seconds:.2f} cores"
                + (f", {self.errors} ERRORS" if self.errors else ""))


def summarize_runs(runs: Sequence[Tally]) -> dict[str, Any]:
    """Median MB/s over repeats, with every repeat kept for the JSON."""
    return {"mb_s": round(median([t.mb_s for t in runs]), 1),
            "runs": [t.record() for t in runs],
            "errors": sum(t.errors for t in runs)}


@dataclass
class Bench:
    """What every job of one run shares: temp root, durations, repeats, load averages."""

    root: Path
    duration: float
    put_duration: float
    repeats: int
    max_uploads: int
    load_avg: list[float] = field(default_factory=list)

    def interleaved(self, targets: Sequence[str]) -> Iterator[tuple[int, str]]:
        """(repeat, target) in run order: every target each repeat, the order alternating,
        so neither side always runs first (e.g. right after a settle pause or writeback).

        Notes the host's 1-minute load average before each measurement: with other work on
        the machine, absolute numbers move and only the side-by-side ratios hold."""
        for r in range(self.repeats):
            for name in (targets if r % 2 == 0 else list(reversed(targets))):
                self.load_avg.append(round(os.getloadavg()[0], 2))
                yield r, name


def settle(services: Iterable[Service]) -> None:
    """Wait until every server is idle again before the next measurement starts.

    Cut-off clients leave work behind: aborted streams, and Redis, asked for 64 x 64 MiB,
    first builds all those replies in memory and frees them only afterwards. That must not
    land in the next target's window.
    """
    time.sleep(SETTLE_S)
    services = list(services)
    deadline = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < deadline:
        before = sum(s.cpu_seconds() for s in services)
        time.sleep(0.2)
        if sum(s.cpu_seconds() for s in services) - before < IDLE_CORES * 0.2:
            return
    log(f"servers still busy after {SETTLE_MAX_S:g}s; measuring anyway")
