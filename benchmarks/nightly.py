"""The nightly tier: the slow extra proofs CI leaves out (`pytest -m nightly`).

    python -m benchmarks nightly            # every nightly test
    python -m benchmarks nightly -k llama   # pytest's own options pass through

pyproject.toml's addopts deselect `-m nightly` from every plain pytest run, so these tests
run only when asked: today the corpus of tests/test_corpus.py on new machines with
precompiled Dynamo off for the four models CI runs with it on only, and the chaos run of
tests/test_chaos.py with 100 stops (CI runs 10). It is a test tier, not a measurement: the
exit status is pytest's, the record is pytest's own report. Run from the repository's root
in the venv of the Quick start (about 70 min on 2 cores).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from benchmarks.harness import REPO

COMMAND = [sys.executable, "-m", "pytest", "-m", "nightly", "-q"]
"""The tier: pytest's `-m` given last on the command line wins over addopts' `not nightly`."""


def main(argv: Sequence[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    return subprocess.run([*COMMAND, *extra], cwd=REPO, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
