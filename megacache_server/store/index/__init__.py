"""Index backends (sqlite.py, redis.py) behind the storage protocols of base.py."""
