"""bigbatch: large-batch distributed training for PyTorch that keeps accuracy.

The pieces compose but stand alone: ``bigbatch.LAMB`` is a plain
``torch.optim.Optimizer``; ``bigbatch.Strategy`` is the one typed config
(Fleet-style TOML sections); ``bigbatch.prepare`` applies a Strategy to your
own training loop.

The subpackages are the layers, each importing only from those before it:
``optim`` and ``adaptive`` (pure algorithms) -> ``config`` -> ``parallel`` ->
``engine`` -> ``train``, ``tasks``, ``study`` -> ``cli``.
"""

from .adaptive import AdaScale, GradientNoiseScale, Policy, adascale, adasum, gns
from .config import BatchPlan, Schedule, Strategy, elastic, scale_lr, scaling, schedules
from .engine import Run, prepare
from .errors import ConfigError
from .optim import LAMB, LARS, param_groups
from .tasks import get_task
from .train import TrainConfig

__version__ = "0.1.0"

__all__ = [
    "LARS", "LAMB", "param_groups",
    "Strategy", "BatchPlan", "Schedule", "scale_lr",
    "prepare", "Run", "Policy",
    "TrainConfig", "get_task",
    "GradientNoiseScale", "AdaScale",
    "ConfigError",
    "adascale", "adasum", "elastic", "gns", "scaling", "schedules",
    "__version__",
]
