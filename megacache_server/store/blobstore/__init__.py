"""Blob store backends (fs.py, s3.py) behind the interface of base.py, each named in
`store.storage.BLOB_STORES`."""
