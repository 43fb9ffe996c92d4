"""The wire contract between trainers and the cache service: what both sides must agree on.

Manifest and event schemas, signing and verification, exit codes, the version, header names
and the route table. Both `megacache_client` and `megacache_server` import it, and it
imports nothing else of the client (a test checks), so a change to the client's internals
cannot break the server, and a reader finds the contract in one folder.
"""
