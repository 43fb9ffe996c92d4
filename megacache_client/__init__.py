"""megacache client: load and publish torch.compile Mega-Cache bundles from a remote cache.

    import megacache_client
    megacache_client.enable(url="http://cache:8787", model="dlrm-v3", code=GIT_SHA)

or set MEGACACHE_URL (and optionally MEGACACHE_MODEL, MEGACACHE_CODE, ...) and let the
autoload hook do it in every process, `torchrun` workers included.
"""

from megacache_client import httpx_import  # noqa: F401  (first: httpx without its CLI)
from megacache_client._version import __version__
from megacache_client.api import cached, disable, enable, session
from megacache_client.config import ClientConfig
from megacache_client.session import MegacacheError, Session

__all__ = ["ClientConfig", "MegacacheError", "Session", "cached", "disable", "enable",
           "session", "__version__"]
