"""Keeping the store within its budget and whole: what to evict (`eviction`), the collector
that runs it in the server or in a child process (`collector`), and the consistency check
of index against blobs (`fsck`)."""
