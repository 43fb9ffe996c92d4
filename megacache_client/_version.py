"""The client's version, alone in a module so any client module can import it without a cycle."""

__version__ = "0.1.0"
