"""Named steps that LARS and LAMB are built from, each written once.

These work on Python floats (norms already reduced), so the reference and the
fast kernels share exactly the same scalar arithmetic.
"""

from __future__ import annotations

import torch


def lars_local_lr(lr: float, coeff: float, w_norm: float, g_norm: float,
                  weight_decay: float, eps: float, trust_clip: bool) -> float:
    """LARS layer-wise learning rate (You et al. 2017, Fleet's lars_momentum).

    ``local_lr = lr * coeff * ||w|| / (||g|| + weight_decay * ||w|| + eps)``;
    ``lr`` itself when either norm is zero, so zero-initialised layers still
    move and nothing divides by zero. With ``trust_clip`` (LARC, Ginsburg et
    al.) it never exceeds ``lr``.
    """
    if w_norm == 0.0 or g_norm == 0.0:
        return lr
    local = lr * coeff * w_norm / (g_norm + weight_decay * w_norm + eps)
    return min(local, lr) if trust_clip else local


def lamb_trust_ratio(w_norm: float, u_norm: float, trust_clip: bool) -> float:
    """LAMB trust ratio ``||w|| / ||u||`` (You et al. 2020), 1 when a norm is 0.

    With ``trust_clip`` the ratio is capped at 1.
    """
    if w_norm == 0.0 or u_norm == 0.0:
        return 1.0
    ratio = w_norm / u_norm
    return min(ratio, 1.0) if trust_clip else ratio


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Divisor that brings a global gradient norm down to ``max_norm`` (1 if below)."""
    if max_norm is None or total_norm <= max_norm:
        return 1.0
    return total_norm / max_norm


def global_grad_norm(grads: list[torch.Tensor]) -> float:
    """L2 norm of all gradients together, as one float (one pass, no copies)."""
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack(norms).double()).item()


def norms(*tensors: torch.Tensor) -> list[float]:
    """L2 norms of several tensors as floats, with one host transfer."""
    return norm_list(list(tensors))


def norm_list(tensors: list[torch.Tensor]) -> list[float]:
    """L2 norm of each tensor as floats: one multi-tensor reduction, one host transfer."""
    return torch.stack(torch._foreach_norm(tensors)).tolist()
