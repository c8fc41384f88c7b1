"""Adaptive large-batch methods as pure estimators (torch and numpy only).

- ``gns``: the gradient noise scale (McCandlish et al. 2018) and its inputs (``norms``);
- ``adascale``: AdaScale's gain (Johnson et al. 2020);
- ``adasum``: Adasum's combination of gradients (Maleki et al. 2021);
- ``goodput``: Pollux's goodput and batch-size tuner (Qiao et al. 2021), with
  its throughput model (``throughput``);
- ``policy``: `Policy`, KungFu's adaptation hooks around the training loop; ``doubling``
  (KungFu's noise-scale batch doubling) and ``straggler`` (detection, rebalancing)
  are the decision rules of built-in policies.

The engine's ``[adaptive]`` controller that drives them lives in
``bigbatch.engine.adaptive``, and the policies' runner in ``bigbatch.engine.policies``.
"""

from . import adascale, adasum, gns, goodput
from .adascale import AdaScale
from .gns import GradientNoiseScale
from .goodput import GoodputTuner
from .policy import Policy

__all__ = ["AdaScale", "GradientNoiseScale", "GoodputTuner", "Policy",
           "adascale", "adasum", "gns", "goodput"]
