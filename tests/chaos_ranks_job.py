"""One rank of the chaos tests' torchrun job (tests/test_chaos.py): in attempt N (torchrun's
TORCHELASTIC_RESTART_COUNT), rank N % 2 stops the way CHAOS_ATTEMPT_STOPS's N-th item says
(`kind:point:delay`, as chaos_job.py's STOP_KIND, STOP_POINT, STOP_DELAY); attempts past
the list train to the end. Each attempt checkpoints to its own directory."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
stops = [s for s in os.environ.get("CHAOS_ATTEMPT_STOPS", "").split(",") if s]
if attempt < len(stops) and int(os.environ["RANK"]) == attempt % 2:
    kind, point, delay = stops[attempt].split(":")
    os.environ.update({"STOP_KIND": kind, "STOP_POINT": point, "STOP_DELAY": delay})
os.environ["CKPT_DIR"] = str(Path(os.environ["CKPT_DIR"]) / str(attempt))
runpy.run_path(str(Path(__file__).with_name("chaos_job.py")), run_name="__main__")
