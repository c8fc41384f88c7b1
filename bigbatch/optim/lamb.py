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

Kernels. The reference computes every ``u``, then all norms together, then
the updates. The per-tensor CPU kernel (``_lamb_cpu.py``) runs torch's fused
Adam kernel into a scratch buffer laid out like ``w``, chunk by chunk, so the
norms and the update follow while the data is still in cache. The
multi-tensor kernel runs the fused Adam kernel over lists into per-tensor
update buffers and keeps norms and ratios as tensors (no host sync).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ._base import LayerwiseOptimizer, fusable, in_param_order
from ._blocks import BLOCK, SMALL, whole_squares
from ._lamb_cpu import (
    LambScratch,
    adam_into,
    direction_into,
    lamb_group_per_tensor,
    step_counts,
)
from ._norms import (
    by_device_and_dtype,
    global_norm,
    is_dtensor,
    local,
    stack,
    whole_norms,
)
from ._params import check_range
from ._steps import adam_direction, clip_coefficient, lamb_trust_ratio

__all__ = ["LAMB"]


class LAMB(LayerwiseOptimizer):
    """LAMB: Adam moments with a per-layer trust ratio.

    Args:
        params: ``model.named_parameters()`` (needed for ``exclude``), plain
            parameters, or param groups with per-group overrides.
        lr: learning rate (a float, or a 0-d tensor).
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
        fast: ``False`` forces the per-tensor reference kernel (as
            ``kernel="reference"``).
        kernel: ``"auto"``, ``"reference"``, ``"per_tensor"`` or
            ``"multi_tensor"``; see ``LayerwiseOptimizer``.
    """

    _name = "LAMB"

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, exclude: Sequence[str] = (),
                 bias_correction: bool = True, max_grad_norm: float | None = None,
                 trust_clip: bool = False, always_adapt: bool = False,
                 fast: bool | None = None, kernel: str = "auto"):
        if not isinstance(lr, torch.Tensor):
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
        super().__init__(params, defaults, exclude, fast, kernel)
        self._scratch = LambScratch(self._scratch_size)

    def _scratch_size(self, dtype: torch.dtype, device: torch.device) -> int:
        """Elements the per-tensor kernel's scratch needs for this kind: the largest
        tensor, or a block of small tensors stepped together, whichever is more."""
        sizes = [local(p).numel() for g in self.param_groups for p in g["params"]
                 if p.dtype == dtype and p.device == device]
        small = sum(n for n in sizes if n < SMALL)
        return max(max(sizes, default=0), min(small, BLOCK))

    def _state(self, w: torch.Tensor, plain: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(step, exp_avg, exp_avg_sq) of ``w``, the moments as local tensors.

        ``plain``: ``w`` is known not to be a DTensor (the per-tensor kernel),
        so the lookups skip unwrapping.
        """
        state = self.state[w]
        if plain and state and state["step"].device == w.device:
            return state["step"], state["exp_avg"], state["exp_avg_sq"]
        here = local(w).device
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=here)
            # zeros_like keeps a dense parameter's strides (and a DTensor's placements).
            state["exp_avg"] = torch.zeros_like(w)
            state["exp_avg_sq"] = torch.zeros_like(w)
        if state["step"].device != here:  # a loaded state dict keeps step where it was saved
            state["step"] = state["step"].to(here)
        return state["step"], local(state["exp_avg"]), local(state["exp_avg_sq"])

    def _clip_gradients(self, work, kernel) -> None:
        """Divide all gradients by ``clip_coefficient`` of their global (whole-tensor) norm."""
        params = [w for _, ps in work for w in ps]
        coef = clip_coefficient(global_norm([w.grad for w in params]), self.max_grad_norm)
        grads = [local(w.grad) for w in params]
        if kernel != "multi_tensor":
            if coef.item() != 1.0:
                torch._foreach_div_(grads, coef.item())
            return
        for idx in by_device_and_dtype(params):
            bucket = [grads[i] for i in idx]
            torch._foreach_div_(bucket, coef.to(device=bucket[0].device, dtype=bucket[0].dtype))

    def _update(self, work, kernel, ratios):
        if self.max_grad_norm is not None:
            self._clip_gradients(work, kernel)
        if kernel == "per_tensor":
            if any(is_dtensor(w) for _, ps in work for w in ps):
                self._per_tensor_sharded(work, ratios)
                return
            for group, params in work:
                done = lamb_group_per_tensor(self._scratch, group, params,
                                             [self._state(w, plain=True) for w in params],
                                             self._adapts(group))
                if ratios is not None:
                    ratios.extend(done)
            return
        # (group, its bucket's parameters, their updates u), buckets in group order.
        pending = []
        buckets = []
        for group, params in work:
            if kernel == "reference":
                buckets.append([[i] for i in range(len(params))])
                pending += [(group, [w], [self._reference_direction(group, w)]) for w in params]
            else:
                buckets.append(by_device_and_dtype(params))
                pending += [(group, ps, self._multi_tensor_direction(group, ps))
                            for ps in ([params[i] for i in idx] for idx in buckets[-1])]
        # All norms of the step reduced together: one collective for sharded parameters.
        adapted = [(w, u) for group, ps, us in pending if self._adapts(group)
                   for w, u in zip(ps, us, strict=True)]
        ws = [w for w, _ in adapted]
        norms = whole_norms(ws + [u for _, u in adapted], ws + ws)
        w_norms = dict(zip(map(id, ws), norms[: len(ws)], strict=True))
        u_norms = dict(zip(map(id, ws), norms[len(ws):], strict=True))
        parts = []
        for group, ps, us in pending:
            if self._adapts(group):
                ratio = lamb_trust_ratio(stack([w_norms[id(w)] for w in ps]),
                                         stack([u_norms[id(w)] for w in ps]), group["trust_clip"])
            else:
                ratio = torch.ones(len(ps), dtype=us[0].dtype, device=us[0].device)
            # w -= lr * ratio * u
            torch._foreach_addcmul_([local(w) for w in ps], us, (-group["lr"] * ratio).unbind())
            parts.append(ratio)
        if ratios is not None:
            for idx in buckets:
                ratios.extend(in_param_order(idx, parts[: len(idx)]))
                parts = parts[len(idx):]

    def _reference_direction(self, group, w) -> torch.Tensor:
        """The readable kernel for one tensor: moments, then ``u = r + weight_decay * w``."""
        beta1, beta2 = group["betas"]
        step, m, v = self._state(w)
        step += 1
        u = torch.empty_like(m)
        adam_direction(u, local(w.grad), m, v, beta1, beta2, group["eps"],
                       int(step.item()) if group["bias_correction"] else None)
        if group["weight_decay"]:
            u.add_(local(w), alpha=group["weight_decay"])
        return u

    def _per_tensor_sharded(self, work, ratios) -> None:
        """The per-tensor kernel on DTensor shards (FSDP2, tensor parallel) on CPU.

        Every local ``u`` by torch's fused Adam kernel; the squared norms of all
        ``w`` and ``u`` summed over their meshes together (one collective) and
        read to the host once (``whole_squares``); ratios on Python floats; one
        ``sub_`` per local shard. The ``u`` buffers live for the step only, as
        in the other kernels: a sharded model's memory between steps stays its
        parameters, gradients and state. (Kept between steps they made the step
        ~25 % faster on ResNet-50 shapes, at the price of one more copy of the
        local parameters held all the time.)
        """
        pending = []
        measured: list[torch.Tensor] = []  # w, u, w, u, ... of the adapted tensors
        owners: list[torch.Tensor] = []
        for group, params in work:
            for w in params:
                w_ = local(w)
                u = self._fused_direction(group, w)
                if self._adapts(group):
                    measured += (w_, u)
                    owners += (w, w)
                pending.append((group, w_, u))
        norms = iter(map(math.sqrt, whole_squares(measured, owners)))
        for group, w_, u in pending:
            ratio = (lamb_trust_ratio(next(norms), next(norms), group["trust_clip"])
                     if self._adapts(group) else 1.0)
            w_.sub_(u, alpha=float(group["lr"]) * ratio)
            if ratios is not None:
                ratios.append(ratio)

    def _fused_direction(self, group, w) -> torch.Tensor:
        """``u`` of one (local) tensor by torch's fused Adam kernel; the reference
        kernel's where the layouts do not let the fused kernel walk raw memory."""
        step, m, v = self._state(w)
        w_, g = local(w), local(w.grad)
        if not fusable(w_, g, m, v):
            return self._reference_direction(group, w)
        step += 1
        u = torch.empty_like(m)
        direction_into(u, w_, g, m, v, step_counts(group, [step]), group)
        return u

    def _multi_tensor_direction(self, group, params) -> list[torch.Tensor]:
        """``u`` for one (device, dtype) bucket: fused Adam over lists, then weight decay."""
        states = [self._state(w) for w in params]
        steps = [s for s, _, _ in states]
        torch._foreach_add_(steps, 1)
        ws = [local(w) for w in params]
        us = [torch.empty_like(m) for _, m, _ in states]
        # The fused kernel walks raw memory: the gradient must share the buffers' layout.
        gs = [g if fusable(u, g) else torch.empty_like(u).copy_(g)
              for u, g in zip(us, (local(w.grad) for w in params), strict=True)]
        torch._foreach_zero_(us)
        adam_into(us, gs, [m for _, m, _ in states], [v for _, _, v in states],
                  step_counts(group, steps), group)
        if group["weight_decay"]:
            torch._foreach_add_(us, ws, alpha=group["weight_decay"])
        return us
