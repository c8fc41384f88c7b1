"""BatchNorm under gradient merge: running statistics that advance once per big batch.

A merged step runs k micro-batches through each BatchNorm layer, so its running
statistics take k updates of momentum m where one big batch would take one. The fix the
large-batch guides name is a smaller momentum: with ``m' = 1 - (1 - m)^(1/k)`` the k
updates decay the old statistics by ``(1 - m')^k = 1 - m``, as one update of the big
batch does, and k identical micro-batches leave exactly the big batch's statistics
(`gradient_merge.bn_momentum = "merged"`).
"""

from __future__ import annotations

from torch import nn

__all__ = ["merge_bn_momentum", "merged_momentum"]


def merged_momentum(momentum: float, k_steps: int) -> float:
    """The per-micro-step momentum whose `k_steps` updates decay as one at `momentum`."""
    return 1.0 - (1.0 - momentum) ** (1.0 / k_steps)


def merge_bn_momentum(model: nn.Module, k_steps: int) -> int:
    """Set every BatchNorm layer's momentum (torch's convention: the new statistic's weight)
    for `k_steps` merged micro-steps; returns how many layers changed. Layers with
    ``momentum=None`` (a cumulative average) are left as they are."""
    changed = 0
    if k_steps <= 1:
        return changed
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is not None:
            module.momentum = merged_momentum(float(module.momentum), k_steps)
            changed += 1
    return changed
