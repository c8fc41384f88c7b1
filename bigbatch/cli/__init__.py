"""The ``bigbatch`` command: one module per command, the preflight checks and argument types."""

from .main import main

__all__ = ["main"]
