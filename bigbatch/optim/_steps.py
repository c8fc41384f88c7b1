"""Named steps that LARS and LAMB are built from, each written once.

The scalar rules take norms as tensors (a 0-d tensor per parameter in the
reference kernel, a stacked 1-d tensor in the multi-tensor kernel) or as
Python floats (the CPU per-tensor kernel, where a tensor op costs ~2 us of
dispatch and a rule of ten of them would cost more than the arithmetic it
guards). The same expression serves both: only ``_where`` and ``_minimum``
look at the type. Nothing here reads a tensor back to the host (a CUDA step
never syncs), and zero norms are selected, not branched on, so a masked-out
denominator is replaced by 1 rather than divided by.
"""

from __future__ import annotations

import torch

Scalar = float | torch.Tensor


def _where(cond, a, b):
    """``torch.where`` for tensors, a conditional expression for Python bools."""
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, a, b)
    return a if cond else b


def _minimum(x, cap):
    """``min(x, cap)`` elementwise (``cap`` a float or a 0-d tensor)."""
    return x.clamp(max=cap) if isinstance(x, torch.Tensor) else min(x, cap)


def lars_local_lr(lr: Scalar, coeff: float, w_norm: Scalar, g_norm: Scalar,
                  weight_decay: float, eps: float, trust_clip: bool) -> Scalar:
    """LARS layer-wise learning rate (You et al. 2017, Fleet's ``lars_momentum``).

    ``adaptive = coeff * ||w|| / (||g|| + weight_decay * ||w|| + eps)`` and

    - scaling mode (LARS): ``local_lr = lr * adaptive``;
    - clipping mode (``trust_clip``, LARC: Ginsburg et al. 2018, NVIDIA apex
      ``LARC(clip=True)``, timm ``Lars(trust_clip=True)``):
      ``local_lr = min(adaptive, lr)``, i.e. ``lr * min(adaptive / lr, 1)``:
      the adaptive rate is used as it is, and only capped at the global rate.

    ``local_lr = lr`` when either norm is zero, so zero-initialised layers still
    move and nothing divides by zero.
    """
    skip = (w_norm == 0) | (g_norm == 0)
    adaptive = coeff * w_norm / _where(skip, 1.0, g_norm + weight_decay * w_norm + eps)
    local = _minimum(adaptive, lr) if trust_clip else lr * adaptive
    return _where(skip, lr, local)


def lars_momentum_coefficients(local_lr: torch.Tensor, prev_lr: torch.Tensor, momentum: float
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How LARS's stored buffer ``b = v / unit`` moves, without branching on values.

    Fleet's velocity is ``v' = momentum * v + local_lr * d``. The buffer is kept
    in units of a learning rate so the update is a momentum-SGD step:
    ``b' = carry * b + d_coef * d`` and ``v' = unit' * b'``, where

    - ``unit' = local_lr`` normally (``carry = momentum * prev / local_lr``,
      ``d_coef = 1``);
    - ``unit' = prev`` when ``local_lr = 0`` (lr = 0 in a warmup): the buffer only
      decays (``carry = momentum``, ``d_coef = 0``);
    - ``unit' = 1`` when both are zero (the buffer is zero anyway).

    Returns ``(unit', carry, d_coef)``.
    """
    zero = local_lr == 0
    unit = torch.where(zero, torch.where(prev_lr == 0, 1.0, prev_lr), local_lr)
    carry = momentum * prev_lr / unit
    d_coef = (~zero).to(unit.dtype)
    return unit, carry, d_coef


def lamb_trust_ratio(w_norm: Scalar, u_norm: Scalar, trust_clip: bool) -> Scalar:
    """LAMB trust ratio ``||w|| / ||u||`` (You et al. 2020), 1 when a norm is 0.

    With ``trust_clip`` the ratio is capped at 1.
    """
    skip = (w_norm == 0) | (u_norm == 0)
    ratio = w_norm / _where(skip, 1.0, u_norm)
    if trust_clip:
        ratio = _minimum(ratio, 1.0)
    return _where(skip, 1.0, ratio)


def adam_direction(out: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                   beta1: float, beta2: float, eps: float, step: int | None) -> None:
    """The readable Adam kernel: update the moments, write ``r = m_hat / (sqrt(v_hat) + eps)``.

    ``step=None`` means no bias correction.
    """
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if step is not None else 1.0
    bc2 = 1 - beta2**step if step is not None else 1.0
    torch.div(m / bc1, (v / bc2).sqrt() + eps, out=out)


def lars_reference_update(w: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                          local_lr: float, prev_lr: float, momentum: float,
                          weight_decay: float, nesterov: bool) -> float:
    """The readable LARS kernel for one tensor; returns the buffer's new unit.

    ``d = g + weight_decay * w``; ``b = momentum * prev / local_lr * b + d``;
    ``w -= local_lr * b`` (nesterov: ``w -= local_lr * (d + momentum * b)``).
    With ``local_lr = 0`` only the velocity decays: ``v = momentum * v``.
    """
    if local_lr == 0.0:
        b.mul_(momentum)
        w.sub_(b, alpha=prev_lr * momentum if nesterov else prev_lr)
        return prev_lr
    d = g + weight_decay * w if weight_decay else g
    b.mul_(momentum * prev_lr / local_lr).add_(d)
    if nesterov:
        w.sub_(d + momentum * b, alpha=local_lr)
    else:
        w.sub_(b, alpha=local_lr)
    return local_lr


def no_bias_correction_step(device: torch.device) -> torch.Tensor:
    """The step count that makes torch's fused Adam skip bias correction.

    An infinite step makes ``1 - beta^t`` exactly 1.
    """
    return torch.full((), float("inf"), device=device)
