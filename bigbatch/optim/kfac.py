"""K-FAC maths: Kronecker-factored approximate curvature, as pure functions over tensors.

**The approximation** (Martens & Grosse 2015). A layer ``s = W a + b`` is one matrix
``W̄ = [W, b]`` (``d_out x (d_in + 1)``) acting on ``ā = [a; 1]`` (the bias column).
Its block of the (empirical) Fisher ``F = E[vec(∇ℓ) vec(∇ℓ)^T]``, with
``∇_W̄ ℓ = g ā^T`` and ``g = ∂ℓ/∂s`` the per-sample gradient of the loss at the output,
is approximated by assuming ``ā`` and ``g`` independent::

    F = E[(ā ā^T) ⊗ (g g^T)]  ≈  A ⊗ G,     A = E[ā ā^T],   G = E[g g^T]

(``⊗`` in ``vec``'s column-major order). Since ``(A ⊗ G)^-1 vec(V) = vec(G^-1 V A^-1)``,
the preconditioned gradient is ``G^-1 ∇W̄ A^-1``: two small inverses instead of one
of size ``(d_in + 1) d_out``.

**Convolutions** (Grosse & Martens 2016, KFC). A convolution is a linear layer applied
at every output position ``t`` of ``T`` to the patch ``ā_t`` (``C_in x kernel`` values,
plus the bias column): ``∇W̄ = Σ_t g_t ā_t^T``. Assuming spatially uncorrelated
derivatives and homogeneous patches, ``F ≈ A ⊗ G`` with, over ``N`` samples::

    A = 1/(N T) Σ_n Σ_t ā_nt ā_nt^T,      G = 1/N Σ_n Σ_t g_nt g_nt^T

(KFC's ``Ω ⊗ Γ``; only the product matters). A linear layer applied at several
positions (inputs ``N x ... x d_in``) is treated the same way, each position a ``t``.

**Damping** (Martens & Grosse 2015, §6.3). Tikhonov damping ``λ`` is split between
the factors as ``(A + π √λ I) ⊗ (G + √λ / π I)``, with
``π = sqrt((tr A / dim A) / (tr G / dim G))``, which makes the damped product
independent of how a scale is shared between ``A`` and ``G``.

**Eigenbases** (Osawa et al. 2019; Pauloski et al. 2020). With ``A = Q_A diag(d_A) Q_A^T``
and ``G = Q_G diag(d_G) Q_G^T``, the damped inverses share the eigenvectors::

    G_λ^-1 V A_λ^-1 = Q_G [(Q_G^T V Q_A) / ((d_G + √λ/π)(d_A + π√λ)^T)] Q_A^T

so a decomposition can be reused for many steps (``inv_update_freq``) and the
factors need not be exactly positive definite (eigenvalues are clamped at 0).

**KL clipping** (Ba, Grosse & Martens 2017; Osawa et al. 2019). With learning rate
``η`` the preconditioned steps ``P_l`` are scaled by
``ν = min(1, sqrt(κ / (η² Σ_l <P_l, ∇_l>)))``, so that the step's predicted change in
the model's output distribution, ``η² g^T F^-1 g``, stays below ``κ = kl_clip``.

**Distribution** (Pauloski et al. 2020): factors are sums, so workers add theirs
(one all-reduce) and normalise after; each decomposition is computed by one worker
and shared. That glue lives in `bigbatch.engine.kfac`; here is only the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LAYER_TYPES",
    "damped_eigen",
    "eigen",
    "factor_sum",
    "grad_matrix",
    "kl_clip_scale",
    "layer_inputs",
    "layer_output_grads",
    "pi_correction",
    "precondition",
    "running_average",
    "set_grad_matrix",
    "unsupported_reason",
]

LAYER_TYPES: dict[str, type[nn.Module]] = {
    "Linear": nn.Linear, "Conv1d": nn.Conv1d, "Conv2d": nn.Conv2d}
"""Layer types K-FAC preconditions, by the names `[kfac] layers` uses."""


def unsupported_reason(module: nn.Module) -> str | None:
    """Why `module` (a Linear/Conv1d/Conv2d) cannot be preconditioned here, or None."""
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        if module.groups != 1:
            return f"groups={module.groups} (only ungrouped convolutions)"
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r} (only zero padding)"
    return None


def _conv_patches(x: torch.Tensor, conv: nn.Conv1d | nn.Conv2d) -> torch.Tensor:
    """Rows of ``C_in x kernel`` patches, one per sample and output position (im2col).

    Strided views of the padded input and one copy: `F.unfold` loops over the samples.
    """
    spatial = len(conv.kernel_size)
    if x.dim() == spatial + 1:  # an unbatched input
        x = x.unsqueeze(0)
    pad = conv.padding
    if pad == "same":  # stride 1; torch puts the odd element at the end
        pad = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True)]
        pairs = [(t // 2, t - t // 2) for t in pad]
    elif pad == "valid":
        pairs = [(0, 0)] * spatial
    else:
        pairs = [(p, p) for p in pad]
    if any(a or b for a, b in pairs):
        x = F.pad(x, [v for pair in reversed(pairs) for v in pair])  # last dimension first
    for i, (k, s, d) in enumerate(zip(conv.kernel_size, conv.stride, conv.dilation, strict=True)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
        if d > 1:  # the window is the new last dimension
            x = x[..., ::d]
    # (N, C, *out, *kernel) -> (N, *out, C, *kernel)
    order = [0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial)]
    x = x.permute(order)
    c_k = x.shape[1 + spatial:].numel()
    return x.reshape(-1, c_k)


def layer_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows ``ā`` whose outer products make ``A``: ``(rows, d_in [+ 1])``.

    Linear: the inputs, every leading position a row; Conv1d/Conv2d: the unfolded
    patches (KFC), one row per sample and output position. With a bias the column
    of ones is appended (its gradient is the last column of `grad_matrix`).
    """
    linear = isinstance(module, nn.Linear)
    rows = x.reshape(-1, x.shape[-1]) if linear else _conv_patches(x, module)
    if module.bias is not None:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def layer_output_grads(module: nn.Module, grad_output: torch.Tensor) -> torch.Tensor:
    """The rows ``g`` whose outer products make ``G``: ``(rows, d_out)``, matching
    `layer_inputs` row for row (channels last for convolutions)."""
    if isinstance(module, nn.Linear):
        return grad_output.reshape(-1, grad_output.shape[-1])
    unbatched = grad_output.dim() == (2 if isinstance(module, nn.Conv1d) else 3)
    g = grad_output.unsqueeze(0) if unbatched else grad_output
    return g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])


def factor_sum(rows: torch.Tensor, out: torch.Tensor | None = None,
               alpha: float = 1.0) -> torch.Tensor:
    """``alpha · rows^T rows`` (a sum over rows; the caller divides by the count),
    added into `out` when given."""
    if out is None:
        return torch.mm(rows.t(), rows) if alpha == 1.0 else torch.mm(rows.t(), rows).mul_(alpha)
    return out.addmm_(rows.t(), rows, alpha=alpha)


def running_average(running: torch.Tensor | None, new: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay · running + (1 - decay) · new``; the first estimate is `new` itself."""
    if running is None:
        return new.clone()
    return running.mul(decay).add_(new, alpha=1.0 - decay)


def grad_matrix(weight_grad: torch.Tensor, bias_grad: torch.Tensor | None) -> torch.Tensor:
    """``∇W̄ = [∇W, ∇b]`` as a ``d_out x (d_in [+ 1])`` matrix (a conv's kernel flattened
    in `layer_inputs`' patch order)."""
    mat = weight_grad.reshape(weight_grad.shape[0], -1)
    if bias_grad is None:
        return mat
    return torch.cat([mat, bias_grad.reshape(-1, 1)], dim=1)


def set_grad_matrix(mat: torch.Tensor, weight_grad: torch.Tensor,
                    bias_grad: torch.Tensor | None) -> None:
    """Copy ``[∇W, ∇b]`` back into the gradients `grad_matrix` was made from."""
    cols = weight_grad[0].numel()
    weight_grad.copy_(mat[:, :cols].reshape(weight_grad.shape))
    if bias_grad is not None:
        bias_grad.copy_(mat[:, cols].reshape(bias_grad.shape))


def pi_correction(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``π = sqrt((tr A / dim A) / (tr G / dim G))`` (Martens & Grosse 2015, eq. 6.3),
    1 where either trace is 0 (a 0-d tensor: no host sync)."""
    a = torch.diagonal(A).sum() / A.shape[0]
    g = torch.diagonal(G).sum() / G.shape[0]
    ok = (a > 0) & (g > 0)
    return torch.where(ok, (a / torch.where(ok, g, 1.0)).sqrt(), 1.0)


def eigen(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, d)`` with ``factor = Q diag(d) Q^T``; eigenvalues clamped at 0 (a factor is
    positive semi-definite; rounding can make tiny ones negative). Symmetrised first."""
    d, Q = torch.linalg.eigh((factor + factor.t()) / 2)
    return Q, d.clamp_(min=0.0)


def damped_eigen(dA: torch.Tensor, dG: torch.Tensor, damping: float,
                 pi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues of the split-damped factors: ``(d_A + π √λ, d_G + √λ / π)``."""
    r = math.sqrt(damping)
    return dA + pi * r, dG + r / pi


def precondition(grad: torch.Tensor, QA: torch.Tensor, dA: torch.Tensor, QG: torch.Tensor,
                 dG: torch.Tensor) -> torch.Tensor:
    """``G_λ^-1 grad A_λ^-1`` through the eigenbases: ``grad`` is ``∇W̄`` (d_out x d_in'),
    ``dA``/``dG`` the damped eigenvalues (`damped_eigen`)."""
    v = QG.t() @ grad @ QA
    v = v / (dG.unsqueeze(1) * dA.unsqueeze(0))
    return QG @ v @ QA.t()


def kl_clip_scale(preconditioned: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  lr: float, kl_clip: float) -> torch.Tensor:
    """``ν = min(1, sqrt(κ / (η² Σ_l <P_l, ∇_l>)))``; 1 when the sum is not positive.

    A 0-d tensor (no host sync); multiply every `preconditioned` tensor by it.
    """
    if not preconditioned:
        return torch.ones(())
    vg = torch.stack([(p * g).sum() for p, g in zip(preconditioned, grads, strict=True)]).sum()
    vg = vg * (lr * lr)
    pos = vg > 0
    return torch.where(pos, (kl_clip / torch.where(pos, vg, 1.0)).sqrt().clamp(max=1.0), 1.0)
