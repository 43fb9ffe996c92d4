"""The steps of the client lifecycle, one module each, in the order a trainer meets them:
`fingerprint` → `prefetch` / `fetch` → `verify` → `load` → `publish` (with `claims` and
`shipping`) → `report`. `lifecycle.Session` runs them; each step raises on trouble and the
session decides what a failure costs. Beside them, all along the run, `progress` sends the
job's time line (`ett/telemetry.py` makes it), and never raises into the trainer.
"""
