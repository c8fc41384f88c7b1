"""Layer-wise adaptive optimizers for large batches, and their parameter groups."""

from . import kfac
from ._params import param_groups
from .lamb import LAMB
from .lars import LARS

__all__ = ["LARS", "LAMB", "kfac", "param_groups"]
