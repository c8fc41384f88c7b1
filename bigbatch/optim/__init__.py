"""Layer-wise adaptive optimizers (LARS, LAMB) and Muon for large batches, and their
parameter groups."""

from . import kfac
from ._params import declared_no_decay, param_groups
from .lamb import LAMB
from .lars import LARS
from .lr_scheduler import ScheduleLR
from .muon import Muon, muon
from .muon_params import muon_param_groups

__all__ = ["LARS", "LAMB", "Muon", "kfac", "muon", "muon_param_groups", "param_groups",
           "declared_no_decay", "ScheduleLR"]
