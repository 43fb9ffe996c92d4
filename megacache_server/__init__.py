"""megacache server: a content-addressed HTTP store for torch.compile cache bundles."""

import os

from megacache_client.wire.version import __version__

# An empty PROMETHEUS_MULTIPROC_DIR means "not set" here (the server then makes its own
# dir under the data dir), but prometheus_client, imported with it, takes any value as set
# and writes its counter files into the working directory. Dropped before it is imported.
if os.environ.get("PROMETHEUS_MULTIPROC_DIR") == "":
    del os.environ["PROMETHEUS_MULTIPROC_DIR"]

__all__ = ["__version__"]
