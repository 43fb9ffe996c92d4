"""Effective Training Time, the trainer's side: where a job's wall time goes, and why.

Rank 0 of a job attempt (`telemetry.py`) hooks the facts of its time line (the start, the
first optimizer step, heartbeats, checkpoints with `checkpoints.py` and the frameworks'
own calls with `frameworks.py`, the data loader's waits with `dataloading.py`, the phases
of the way to the first step with `phases.py`, the cause of the end with `causes.py`) and
hands them to the sender (`sender.py`), which posts them in the background. A killed
attempt says nothing: its life is kept on the node (`lifeline.py`), and the next attempt
there reads how it died (`postmortem.py`) and which run of the job it was (`runs.py`).

Nothing here is on the cache's path: the lifecycle (`lifecycle.py`) and its steps never
import this package; the public API (`api.py`) starts it.
"""
