"""bigbatch: large-batch distributed training for PyTorch that keeps accuracy."""

__version__ = "0.1.0"

__all__ = ["__version__"]
