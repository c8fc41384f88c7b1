"""bigbatch: large-batch distributed training for PyTorch that keeps accuracy.

The pieces compose but stand alone: ``bigbatch.LAMB`` is a plain
``torch.optim.Optimizer``; ``bigbatch.Strategy`` is the one typed config
(Fleet-style TOML sections); ``bigbatch.prepare`` applies a Strategy to your
own training loop.
"""

from . import adascale, adasum, elastic, gns, scaling, schedules
from .adascale import AdaScale
from .engine import Run, prepare
from .errors import ConfigError
from .gns import GradientNoiseScale
from .optim import LAMB, LARS, param_groups
from .scaling import scale_lr
from .schedules import Schedule
from .strategy import BatchPlan, Strategy
from .tasks import get_task
from .train import TrainConfig

__version__ = "0.1.0"

__all__ = [
    "LARS", "LAMB", "param_groups",
    "Strategy", "BatchPlan", "Schedule", "scale_lr",
    "prepare", "Run",
    "TrainConfig", "get_task",
    "GradientNoiseScale", "AdaScale",
    "ConfigError",
    "adascale", "adasum", "elastic", "gns", "scaling", "schedules",
    "__version__",
]
