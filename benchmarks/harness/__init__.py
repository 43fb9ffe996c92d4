"""What the benchmarks and the tests share: simulated machines and training jobs as fresh
processes (`machines`), the server, Redis and SeaweedFS on loopback ports (`servers`), the
small models (`models`), the third-party corpus (`corpus_job`), and the reporting helpers
of the benchmarks (`benchlib`, `results_md`, `record`).

The `*_job.py` scripts, `lookup_load.py` and `hostile.py` run as processes of their own,
by path (`python benchmarks/harness/train_job.py ...`, under torchrun too): they import
the harness as `benchmarks.harness`, which the editable install (`pip install -e .`)
puts on every process's path. Importing this package imports nothing but pathlib: a
training job's start-up timing includes it.
"""

from pathlib import Path

HARNESS = Path(__file__).resolve().parent
BENCH_DIR = HARNESS.parent
REPO = BENCH_DIR.parent

TRAIN_JOB = HARNESS / "train_job.py"
"""A compiled model trained a few steps (benchmarks/harness/models.py's models)."""
CORPUS_JOB = HARNESS / "corpus_job.py"
"""A third-party (transformers) model trained a few steps, zero-code."""
STAGE_JOB = HARNESS / "stage_job.py"
"""One rank of a torchrun job whose ranks compile different things."""
FRAMEWORK_JOB = HARNESS / "framework_job.py"
"""A framework's trainer (HF Trainer, Accelerate, Lightning), killed and resumed."""
ETT_CAUSES_JOB = HARNESS / "ett_causes_job.py"
"""A trainer that fails by one cause, then recovers."""
LOOKUP_LOAD = HARNESS / "lookup_load.py"
"""Exact lookups back to back from a process of their own."""
HOSTILE = HARNESS / "hostile.py"
"""The load test's hostile tenant, in a process of its own."""
