"""megacache client: load and publish torch.compile Mega-Cache bundles from a remote cache."""

__version__ = "0.1.0"
