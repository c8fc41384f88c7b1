"""LAMB: layer-wise adaptive moments (You et al. 2020, "Large Batch Optimization
for Deep Learning: Training BERT in 76 minutes").

Update, as in PaddlePaddle Fleet's ``lamb`` kernel::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    r = m_hat / (sqrt(v_hat) + eps)          (bias-corrected moments)
    u = r + lamb_weight_decay * w
    w = w - lr * ||w|| / ||u|| * u           (ratio 1 when either norm is 0)

With ``max_grad_norm`` the gradients are first scaled onto the bound when their global norm
exceeds it (in place, `bigbatch.optim.clip`, like ``clip_grad_norm_``), as NVIDIA's
LAMB does.

Kernels, behind one function ``lamb(params, grads, states, ..., kernel=)``
(the ``LAMB`` class is a shell over it). The reference computes every ``u``,
then all norms together, then the updates. The per-tensor CPU kernel
(``_lamb_cpu.py``) runs torch's fused Adam kernel into a scratch buffer laid
out like ``w``, chunk by chunk, so the norms and the update follow while the
data is still in cache. The multi-tensor kernel runs the fused Adam kernel
over lists into per-tensor update buffers and keeps norms and ratios as
tensors (no host sync). The Triton kernel (``_triton_steps.py``) takes every
tensor in one launch per pass: moments and both squared norms in the first,
the trust-ratio update in the second (no host sync either).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ._base import LayerwiseOptimizer, fusable, in_param_order, split_runs, state_dtype
from ._blocks import BLOCK, SMALL, whole_squares
from ._lamb_cpu import (
    LambScratch,
    adam_into,
    direction_into,
    lamb_group_per_tensor,
    step_counts,
)
from ._norms import (
    any_dtensor,
    by_device_and_dtype,
    global_norm,
    is_dtensor,
    local,
    stack,
    whole_norms,
)
from ._params import check_range
from ._steps import adam_direction, lamb_trust_ratio
from .clip import clip_grads_
from .warm_start import from_adam

__all__ = ["LAMB", "lamb"]

# (step, exp_avg, exp_avg_sq) of one parameter: a 0-d float32 count and local tensors.
LambState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def lamb(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
         states: Sequence[LambState], *, lr: float | torch.Tensor = 1e-3,
         betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
         weight_decay: float = 0.0, bias_correction: bool = True, trust_clip: bool = False,
         adapt: bool = True, groups: Sequence[tuple[dict, int]] | None = None,
         max_grad_norm: float | None = None, kernel: str = "reference",
         ratios: list | None = None, scratch: LambScratch | None = None,
         workspace=None, found_inf: torch.Tensor | None = None) -> None:
    """One LAMB step (the module docstring's update) over tensor lists, in place.

    ``params`` (plain tensors or DTensors), their ``grads``, and ``states``
    (``(step, exp_avg, exp_avg_sq)`` per parameter; ``step`` counts this step).
    The keywords hold one group's hyperparameters (``adapt``: apply the trust
    ratio); or ``groups`` lists ``(options, count)`` runs covering ``params`` in
    order, ``options`` keyed like the keywords, so that several param groups
    take one step together: one global clip, one collective for all norms.

    ``kernel``: ``"reference"``, ``"per_tensor"``, ``"multi_tensor"`` or
    ``"triton"`` (see ``LayerwiseOptimizer``). The trust ratios are appended to
    ``ratios`` in parameter order when it is a list. ``scratch`` (per-tensor)
    and ``workspace`` (Triton: a dict) are buffers a caller
    keeps between steps; without them each step makes its own.
    ``found_inf``: a 0-d overflow flag (``torch.amp.GradScaler``'s): where it is
    nonzero the step changes nothing. The Triton kernel reads it on the device; the
    other kernels read it to the host first.
    """
    if groups is None:
        groups = [(dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clip=trust_clip, adapt=adapt),
                   len(params))]
    runs = split_runs(groups, params, grads, states)
    if kernel == "triton":
        from ._triton_steps import lamb_triton

        lamb_triton(runs, max_grad_norm, ratios, workspace, found_inf)
        return
    if found_inf is not None and bool(found_inf):
        return
    if max_grad_norm is not None:
        _clip_gradients(params, grads, max_grad_norm, kernel)
    if kernel == "per_tensor":
        if any(is_dtensor(w) for w in params):
            _per_tensor_sharded(runs, ratios)
            return
        scratch = scratch or LambScratch(lambda dtype, device: 0)
        for opts, ps, gs, ss in runs:
            done = lamb_group_per_tensor(scratch, opts, ps, gs, ss)
            if ratios is not None:
                ratios.extend(done)
        return
    if kernel not in ("reference", "multi_tensor"):
        raise ValueError(f"lamb: kernel={kernel!r} should be 'reference', 'per_tensor', "
                         "'multi_tensor' or 'triton'")
    _reference_or_multi_tensor(runs, kernel, ratios)


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
        kernel: ``"auto"``, ``"reference"``, ``"per_tensor"``, ``"multi_tensor"``
            or ``"triton"``; see ``LayerwiseOptimizer``.
    """

    _name = "LAMB"
    _state_keys = ("step", "exp_avg", "exp_avg_sq")
    _warm_start = (from_adam, "Adam-family moments (exp_avg, exp_avg_sq: Adam, AdamW, timm's Lamb)")

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

    def _state(self, w: torch.Tensor, plain: bool = False, kernel: str = ""
               ) -> LambState:
        """(step, exp_avg, exp_avg_sq) of ``w``, the moments as local tensors.

        ``plain``: ``w`` is known not to be a DTensor, so the lookups skip
        unwrapping. New moments take ``state_dtype`` (float32 for low-precision
        parameters under the Triton kernel).
        """
        state = self.state[w]
        if plain and state and state["step"].device == w.device:
            return state["step"], state["exp_avg"], state["exp_avg_sq"]
        here = local(w).device
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=here)
            # zeros_like keeps a dense parameter's strides (and a DTensor's placements).
            dtype = state_dtype(w, kernel)
            state["exp_avg"] = torch.zeros_like(w, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(w, dtype=dtype)
        if state["step"].device != here:  # a loaded state dict keeps step where it was saved
            state["step"] = state["step"].to(here)
        return state["step"], local(state["exp_avg"]), local(state["exp_avg_sq"])

    def _stored(self, w: torch.Tensor) -> LambState | None:
        """``w``'s state as stored, or None before its first step."""
        state = self.state.get(w)
        return (state["step"], state["exp_avg"], state["exp_avg_sq"]) if state else None

    def _update(self, work, kernel, ratios, found_inf=None):
        params = [w for _, ps in work for w in ps]
        plain = not any_dtensor(params)
        if kernel == "triton" and plain:  # the kernels check devices and layouts themselves
            states = [self._stored(w) or self._state(w, plain, kernel) for w in params]
        else:
            states = [self._state(w, plain, kernel) for w in params]
        lamb(params, [w.grad for w in params], states,
             groups=[({**g, "adapt": self._adapts(g)}, len(ps)) for g, ps in work],
             max_grad_norm=self.max_grad_norm, kernel=kernel, ratios=ratios,
             scratch=self._scratch, workspace=self._workspace, found_inf=found_inf)


def _clip_gradients(params, grads, max_grad_norm: float, kernel: str) -> None:
    """Clip the global (whole-tensor) gradient norm to `max_grad_norm`: the engine's
    clipping function (`bigbatch.optim.clip`); the Triton kernel does the same in its
    first pass."""
    grads = list(grads)
    clip_grads_(grads, global_norm(grads), max_grad_norm)


def _reference_or_multi_tensor(runs, kernel: str, ratios: list | None) -> None:
    """Every ``u`` first, then all norms of the step together (one collective for
    sharded parameters), then ``w -= lr * ratio * u`` per bucket."""
    # (options, its bucket's parameters, their updates u), buckets in group order.
    pending = []
    buckets = []
    for opts, ps, gs, ss in runs:
        if kernel == "reference":
            buckets.append([[i] for i in range(len(ps))])
            pending += [(opts, [w], [_reference_direction(opts, w, g, s)])
                        for w, g, s in zip(ps, gs, ss, strict=True)]
        else:
            buckets.append(by_device_and_dtype(ps))
            pending += [(opts, [ps[i] for i in idx],
                         _multi_tensor_direction(opts, [ps[i] for i in idx],
                                                 [gs[i] for i in idx], [ss[i] for i in idx]))
                        for idx in buckets[-1]]
    adapted = [(w, u) for opts, ps, us in pending if opts["adapt"]
               for w, u in zip(ps, us, strict=True)]
    ws = [w for w, _ in adapted]
    norms = whole_norms(ws + [u for _, u in adapted], ws + ws)
    w_norms = dict(zip(map(id, ws), norms[: len(ws)], strict=True))
    u_norms = dict(zip(map(id, ws), norms[len(ws):], strict=True))
    parts = []
    for opts, ps, us in pending:
        if opts["adapt"]:
            ratio = lamb_trust_ratio(stack([w_norms[id(w)] for w in ps]),
                                     stack([u_norms[id(w)] for w in ps]), opts["trust_clip"])
        else:
            ratio = torch.ones(len(ps), dtype=us[0].dtype, device=us[0].device)
        # w -= lr * ratio * u
        torch._foreach_addcmul_([local(w) for w in ps], us, (-opts["lr"] * ratio).unbind())
        parts.append(ratio)
    if ratios is not None:
        for idx in buckets:
            ratios.extend(in_param_order(idx, parts[: len(idx)]))
            parts = parts[len(idx):]


def _reference_direction(opts, w, g, state: LambState) -> torch.Tensor:
    """The readable kernel for one tensor: moments, then ``u = r + weight_decay * w``."""
    beta1, beta2 = opts["betas"]
    step, m, v = state
    step += 1
    u = torch.empty_like(m)
    adam_direction(u, local(g), m, v, beta1, beta2, opts["eps"],
                   int(step.item()) if opts["bias_correction"] else None)
    if opts["weight_decay"]:
        u.add_(local(w), alpha=opts["weight_decay"])
    return u


def _per_tensor_sharded(runs, ratios: list | None) -> None:
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
    for opts, ps, gs, ss in runs:
        for w, g, state in zip(ps, gs, ss, strict=True):
            w_ = local(w)
            u = _fused_direction(opts, w, g, state)
            if opts["adapt"]:
                measured += (w_, u)
                owners += (w, w)
            pending.append((opts, w_, u))
    norms = iter(map(math.sqrt, whole_squares(measured, owners)))
    for opts, w_, u in pending:
        ratio = (lamb_trust_ratio(next(norms), next(norms), opts["trust_clip"])
                 if opts["adapt"] else 1.0)
        w_.sub_(u, alpha=float(opts["lr"]) * ratio)
        if ratios is not None:
            ratios.append(ratio)


def _fused_direction(opts, w, g, state: LambState) -> torch.Tensor:
    """``u`` of one (local) tensor by torch's fused Adam kernel; the reference
    kernel's where the layouts do not let the fused kernel walk raw memory."""
    step, m, v = state
    w_, g_ = local(w), local(g)
    if not fusable(w_, g_, m, v):
        return _reference_direction(opts, w, g, state)
    step += 1
    u = torch.empty_like(m)
    direction_into(u, w_, g_, m, v, step_counts(opts, [step]), opts)
    return u


def _multi_tensor_direction(opts, params, grads, states: list[LambState]) -> list[torch.Tensor]:
    """``u`` for one (device, dtype) bucket: fused Adam over lists, then weight decay."""
    steps = [s for s, _, _ in states]
    torch._foreach_add_(steps, 1)
    ws = [local(w) for w in params]
    us = [torch.empty_like(m) for _, m, _ in states]
    # The fused kernel walks raw memory: the gradient must share the buffers' layout.
    gs = [g if fusable(u, g) else torch.empty_like(u).copy_(g)
          for u, g in zip(us, (local(g) for g in grads), strict=True)]
    torch._foreach_zero_(us)
    adam_into(us, gs, [m for _, m, _ in states], [v for _, _, v in states],
              step_counts(opts, steps), opts)
    if opts["weight_decay"]:
        torch._foreach_add_(us, ws, alpha=opts["weight_decay"])
    return us
