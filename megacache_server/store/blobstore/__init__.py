"""Blob store backends (fs.py, s3.py) behind the interface of base.py."""
