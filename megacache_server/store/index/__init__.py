"""Index backends (`sqlite/`, `redis/`) behind the storage protocols of base.py; how events
fold into rollups is shared by both (`rollups.py`, `period_sums.py`)."""
