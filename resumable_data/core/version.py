"""The library's version, in a module of its own so every module can import it without a cycle."""

__version__ = "0.1.0"
