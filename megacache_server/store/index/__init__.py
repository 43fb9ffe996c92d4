"""Index backends (`sqlite/`, `redis/`) behind the storage protocols of `protocols/` (one
module per role; `base.Index` is all of them); how events fold into rollups is shared by
both (`rollups.py`, `period_sums.py`)."""
