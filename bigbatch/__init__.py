"""bigbatch: large-batch distributed training for PyTorch that keeps accuracy.

The pieces compose but stand alone: ``bigbatch.LAMB`` is a plain
``torch.optim.Optimizer``; ``bigbatch.Strategy`` is the one typed config
(Fleet-style TOML sections); ``bigbatch.prepare`` applies a Strategy to your
own training loop.

The subpackages are the layers, each importing only from those before it:
``optim`` and ``adaptive`` (pure algorithms) -> ``config`` -> ``parallel`` ->
``engine`` -> ``train``, ``tasks``, ``study``, ``planner`` -> ``cli``. ``bigbatch.plan``
lays a strategy out for N ranks on the meta device (``bigbatch plan`` on the command line).

Names load on first use, so ``import bigbatch.optim`` (or ``from bigbatch import LAMB``)
needs torch alone, not the config, training or plotting dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it (a module itself when the name is the module's);
# "module:attr" where a function shares its module's name.
_WHERE = {
    "LARS": "bigbatch.optim", "LAMB": "bigbatch.optim", "param_groups": "bigbatch.optim",
    "Muon": "bigbatch.optim", "muon_param_groups": "bigbatch.optim",
    "Strategy": "bigbatch.config", "BatchPlan": "bigbatch.config",
    "Schedule": "bigbatch.config", "scale_lr": "bigbatch.config",
    "prepare": "bigbatch.engine", "Run": "bigbatch.engine",
    "build_optimizer": "bigbatch.engine.optimizer", "build_scheduler": "bigbatch.engine.optimizer",
    "ScheduleLR": "bigbatch.optim.lr_scheduler",
    "ModelPlan": "bigbatch.parallel.model_plan",
    "TrainConfig": "bigbatch.train", "get_task": "bigbatch.tasks",
    "GradientNoiseScale": "bigbatch.adaptive", "AdaScale": "bigbatch.adaptive",
    "Policy": "bigbatch.adaptive",
    "ConfigError": "bigbatch.errors", "PipelineError": "bigbatch.errors",
    "SaveStateError": "bigbatch.errors", "UntrustedFileError": "bigbatch.errors",
    "adascale": "bigbatch.adaptive.adascale", "adasum": "bigbatch.adaptive.adasum",
    "gns": "bigbatch.adaptive.gns", "elastic": "bigbatch.config.elastic",
    "scaling": "bigbatch.config.scaling", "schedules": "bigbatch.config.schedules",
    "kfac": "bigbatch.optim.kfac",
    "lr_find": "bigbatch.study.lr_find:lr_find",
    "plan": "bigbatch.planner.planning:plan", "LayoutPlan": "bigbatch.planner.result",
}

__all__ = [
    "LARS", "LAMB", "Muon", "param_groups", "muon_param_groups",
    "Strategy", "BatchPlan", "Schedule", "scale_lr",
    "prepare", "Run", "Policy", "ModelPlan", "build_optimizer", "build_scheduler", "ScheduleLR",
    "TrainConfig", "get_task",
    "GradientNoiseScale", "AdaScale",
    "ConfigError", "PipelineError", "SaveStateError", "UntrustedFileError",
    "adascale", "adasum", "elastic", "gns", "kfac", "scaling", "schedules",
    "lr_find", "plan", "LayoutPlan",
    "__version__",
]


_SUBPACKAGES = ("adaptive", "cli", "config", "engine", "errors", "optim", "parallel", "planner",
                "study", "tasks", "train")


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name) or (f"bigbatch.{name}" if name in _SUBPACKAGES else None)
    if where is None:
        raise AttributeError(f"module 'bigbatch' has no attribute {name!r}")
    where, _, attr = where.partition(":")
    module = importlib.import_module(where)
    value = getattr(module, attr) if attr else (
        module if where.endswith("." + name) else getattr(module, name))
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
