"""LARS: layer-wise adaptive rate scaling with momentum (You et al. 2017).

Update, as in PaddlePaddle Fleet's ``lars_momentum`` kernel::

    local_lr = lr * lars_coeff * ||w|| / (||g|| + lars_weight_decay * ||w|| + epsilon)
    v = momentum * v + local_lr * (g + lars_weight_decay * w)
    w = w - v                       (nesterov: w = w - (momentum * v + local_lr * d))

State layout. Fleet's velocity ``v`` carries the learning rate, and
``local_lr`` changes every step, so ``v`` is stored as ``momentum_buffer =
v / local_lr`` together with ``local_lr`` (the value it was divided by). The
recurrence then reads ``b = momentum * (local_lr_prev / local_lr) * b + d``,
``w -= local_lr * b``: exactly torch's fused SGD kernel with a per-tensor
momentum, which updates ``b`` and ``w`` in one pass. ``velocity(p)`` returns
``v`` in Fleet's units.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ._base import LayerwiseOptimizer
from ._params import check_range
from ._steps import lars_local_lr, norm_list

__all__ = ["LARS"]


class LARS(LayerwiseOptimizer):
    """LARS: momentum SGD with a per-layer learning rate from the trust ratio.

    Args:
        params: ``model.named_parameters()`` (needed for ``exclude``), plain
            parameters, or param groups with per-group overrides.
        lr: global learning rate (scheduled as usual through ``param_groups``).
        momentum: momentum ``mu`` in ``[0, 1)``.
        weight_decay: Fleet ``lars_weight_decay``; part of the trust ratio.
        trust_coefficient: Fleet ``lars_coeff``.
        eps: Fleet ``epsilon``, added to the trust-ratio denominator.
        nesterov: Nesterov momentum.
        exclude: parameter-name substrings (Fleet ``exclude_from_weight_decay``,
            e.g. ``("bn", "bias")``); matching parameters take a plain
            momentum-SGD step: no weight decay and no trust ratio.
        trust_clip: LARC clipping, ``local_lr <= lr``.
        always_adapt: keep the trust ratio for excluded parameters too.
        fast: ``None`` picks the fused kernel where possible; ``False`` forces
            the per-tensor reference kernel.
    """

    _name = "LARS"

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.9,
                 weight_decay: float = 5e-4, trust_coefficient: float = 1e-3,
                 eps: float = 0.0, nesterov: bool = False, exclude: Sequence[str] = (),
                 trust_clip: bool = False, always_adapt: bool = False,
                 fast: bool | None = None):
        check_range("LARS", "lr", lr, 0.0)
        check_range("LARS", "momentum", momentum, 0.0, 1.0, high_open=True)
        check_range("LARS", "weight_decay", weight_decay, 0.0)
        check_range("LARS", "trust_coefficient", trust_coefficient, 0.0, low_open=True)
        check_range("LARS", "eps", eps, 0.0)
        if nesterov and momentum == 0.0:
            raise ValueError("LARS: nesterov=True needs momentum > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        trust_clip=trust_clip, always_adapt=always_adapt)
        super().__init__(params, defaults, exclude, fast)

    def velocity(self, p: torch.Tensor) -> torch.Tensor | None:
        """Fleet's velocity ``v`` for parameter ``p`` (None before its first step)."""
        state = self.state.get(p)
        if not state:
            return None
        return state["momentum_buffer"] * state["local_lr"]

    def _group_step(self, group, params, fast, ratios):
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        adapt = self._adapts(group)
        if adapt:
            # All norms in one multi-tensor call and one host transfer: far cheaper
            # than a reduction and a sync per tensor.
            w_norms = norm_list(params)
            g_norms = norm_list([w.grad for w in params])
        for i, w in enumerate(params):
            g = w.grad
            state = self.state[w]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(w)
                state["local_lr"] = 0.0
            b = state["momentum_buffer"]
            if adapt:
                local = lars_local_lr(lr, group["trust_coefficient"], w_norms[i], g_norms[i],
                                      wd, group["eps"], group["trust_clip"])
            else:
                local = lr
            if ratios is not None:
                ratios.append(local / lr if lr > 0 else 1.0)
            prev = state["local_lr"]
            if local == 0.0:
                # lr = 0 (e.g. warmup from zero): v = mu * v, still in units of prev.
                b.mul_(mu)
                w.sub_(b, alpha=prev * mu if group["nesterov"] else prev)
                continue
            carry = mu * prev / local
            if fast and not group["nesterov"]:
                # The kernel wants momentum > 0; with carry 0 its first-step mode sets b = d.
                torch._fused_sgd_([w], [g], [b], weight_decay=wd, momentum=carry or 1.0,
                                  lr=local, dampening=0.0, nesterov=False, maximize=False,
                                  is_first_step=carry == 0.0)
            else:
                _lars_reference(w, g, b, carry, local, mu, wd, group["nesterov"])
            state["local_lr"] = local


def _lars_reference(w, g, b, carry, local_lr, mu, wd, nesterov):
    """The readable kernel for one tensor: ``b = carry * b + d``; ``w -= local_lr * b``."""
    d = g + wd * w if wd else g
    b.mul_(carry).add_(d)
    if nesterov:
        w.sub_(d + mu * b, alpha=local_lr)
    else:
        w.sub_(b, alpha=local_lr)
