"""megacache server: a content-addressed HTTP store for torch.compile cache bundles."""

__version__ = "0.1.0"
