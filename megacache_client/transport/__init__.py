"""The one HTTP client between a trainer and the cache service (`client.RemoteCache`), with
its manners: retries with backoff, a circuit breaker per node, deadlines (`exchange`), and its
routes by what they talk to (`entries`, `blobs`, `reporting`).

Importing the package imports httpx without its command-line client (`httpx_import`): every
module here that imports httpx is imported after this line.
"""

from megacache_client.transport import httpx_import  # noqa: F401
