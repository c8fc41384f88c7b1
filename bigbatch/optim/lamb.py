"""LAMB: layer-wise adaptive moments (You et al. 2020, "Large Batch Optimization
for Deep Learning: Training BERT in 76 minutes").

Update, as in PaddlePaddle Fleet's ``lamb`` kernel::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    r = m_hat / (sqrt(v_hat) + eps)          (bias-corrected moments)
    u = r + lamb_weight_decay * w
    w = w - lr * ||w|| / ||u|| * u           (ratio 1 when either norm is 0)

With ``max_grad_norm`` the gradients are first divided by their global norm
when it exceeds the bound (in place, like ``clip_grad_norm_``), as NVIDIA's
LAMB does.

Fast kernel, per tensor: torch's fused Adam kernel writes ``r`` into one
scratch buffer shared by all tensors (the moments update in the same pass),
then the norms, ``u`` and the update follow while ``w`` and the scratch are
still in cache. Memory traffic is close to the 40 bytes per fp32 parameter a
two-pass LAMB needs, and the step allocates nothing but that buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ._base import LayerwiseOptimizer
from ._params import check_range
from ._steps import clip_coefficient, global_grad_norm, lamb_trust_ratio, norms

__all__ = ["LAMB"]


class LAMB(LayerwiseOptimizer):
    """LAMB: Adam moments with a per-layer trust ratio.

    Args:
        params: ``model.named_parameters()`` (needed for ``exclude``), plain
            parameters, or param groups with per-group overrides.
        lr: learning rate.
        betas: Adam's ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)``.
        weight_decay: Fleet ``lamb_weight_decay`` (decoupled, inside ``u``).
        exclude: parameter-name substrings (Fleet ``exclude_from_weight_decay``,
            e.g. ``("norm", "bias")``); matching parameters take an Adam step:
            no weight decay and no trust ratio.
        bias_correction: divide the moments by ``1 - beta^t``.
        max_grad_norm: clip the global gradient norm to this before the step.
        trust_clip: cap the trust ratio at 1.
        always_adapt: keep the trust ratio for excluded parameters too.
        fast: ``None`` picks the fused kernel where possible; ``False`` forces
            the per-tensor reference kernel.
    """

    _name = "LAMB"

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, exclude: Sequence[str] = (),
                 bias_correction: bool = True, max_grad_norm: float | None = None,
                 trust_clip: bool = False, always_adapt: bool = False,
                 fast: bool | None = None):
        check_range("LAMB", "lr", lr, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"LAMB: betas={betas!r} should be a pair (beta1, beta2)")
        check_range("LAMB", "betas[0]", betas[0], 0.0, 1.0, high_open=True)
        check_range("LAMB", "betas[1]", betas[1], 0.0, 1.0, high_open=True)
        check_range("LAMB", "eps", eps, 0.0)
        check_range("LAMB", "weight_decay", weight_decay, 0.0)
        if max_grad_norm is not None:
            check_range("LAMB", "max_grad_norm", max_grad_norm, 0.0, low_open=True)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clip=trust_clip,
                        always_adapt=always_adapt)
        self.max_grad_norm = max_grad_norm
        self._scratch: torch.Tensor | None = None
        super().__init__(params, defaults, exclude, fast)

    def _before_step(self):
        if self.max_grad_norm is None:
            return
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        clip = clip_coefficient(global_grad_norm(grads), self.max_grad_norm)
        if clip != 1.0:
            torch._foreach_div_(grads, clip)

    def _scratch_for(self, w: torch.Tensor) -> torch.Tensor:
        """A view of the one shared update buffer, shaped like ``w``."""
        s = self._scratch
        if s is None or s.numel() < w.numel() or s.dtype != w.dtype or s.device != w.device:
            biggest = max(p.numel() for g in self.param_groups for p in g["params"]
                          if p.dtype == w.dtype and p.device == w.device)
            s = self._scratch = torch.empty(biggest, dtype=w.dtype, device=w.device)
        return s[: w.numel()].view_as(w)

    def _group_step(self, group, params, fast, ratios):
        beta1, beta2 = group["betas"]
        wd, eps, lr = group["weight_decay"], group["eps"], group["lr"]
        adapt = self._adapts(group)
        for w in params:
            state = self.state[w]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=w.device)
                state["exp_avg"] = torch.zeros_like(w)
                state["exp_avg_sq"] = torch.zeros_like(w)
            state["step"] += 1
            m, v = state["exp_avg"], state["exp_avg_sq"]
            u = self._scratch_for(w)
            if fast:
                # bias_correction=False: an infinite step makes 1 - beta^t exactly 1.
                step = state["step"] if group["bias_correction"] else _INF_STEP.to(w.device)
                u.zero_()
                torch._fused_adam_([u], [w.grad], [m], [v], [], [step], lr=-1.0,
                                   beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps,
                                   amsgrad=False, maximize=False)
            else:
                _adam_direction(u, w.grad, m, v, beta1, beta2, eps,
                                int(state["step"].item()) if group["bias_correction"] else None)
            if wd:
                u.add_(w, alpha=wd)
            ratio = lamb_trust_ratio(*norms(w, u), group["trust_clip"]) if adapt else 1.0
            if ratios is not None:
                ratios.append(ratio)
            w.sub_(u, alpha=lr * ratio)


_INF_STEP = torch.tensor(float("inf"))


def _adam_direction(out, g, m, v, beta1, beta2, eps, step):
    """The readable kernel: update the moments, write ``r = m_hat / (sqrt(v_hat) + eps)``."""
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if step is not None else 1.0
    bc2 = 1 - beta2**step if step is not None else 1.0
    torch.div(m / bc1, (v / bc2).sqrt() + eps, out=out)
