"""megacache server: a content-addressed HTTP store for torch.compile cache bundles."""

from megacache_client._version import __version__

__all__ = ["__version__"]
