"""Effective Training Time, the server's side: where each job's wall time went, and why.

The intake (`intake.py`) takes each job's time line as rank 0 sends it (`POST
/v1/jobs/{job}/progress`), heartbeats coalesced per process (`beats.py`); the split
(`split.py`) paints an attempt's time into training, startup, compile, checkpoint save and
restore, lost training, recovery and idle, with each failure's cause; `components.py`
splits each start and recovery into its parts; `split_cache.py` keeps recent splits,
bounded in bytes; `report.py` makes the job's report, `metrics.py` its Prometheus series
(each namespace its own share), and `trend.py` with `roller.py` the fleet per hour and day.
The routes are `api/routes/ett.py`. Nothing here is on the cache's lookup path.
"""
