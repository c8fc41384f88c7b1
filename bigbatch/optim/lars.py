"""LARS: layer-wise adaptive rate scaling with momentum (You et al. 2017), and
LARC's clipping mode (Ginsburg et al. 2018).

Update, as in PaddlePaddle Fleet's ``lars_momentum`` kernel::

    adaptive = lars_coeff * ||w|| / (||g|| + lars_weight_decay * ||w|| + epsilon)
    local_lr = lr * adaptive                (LARC, trust_clip: min(adaptive, lr))
    v = momentum * v + local_lr * (g + lars_weight_decay * w)
    w = w - v                       (nesterov: w = w - (momentum * v + local_lr * d))

State layout. Fleet's velocity ``v`` carries the learning rate, and
``local_lr`` changes every step, so ``v`` is stored as ``momentum_buffer =
v / local_lr`` together with ``local_lr`` (the value it was divided by, a 0-d
tensor; state dicts with a Python float there still load). The recurrence
then reads ``b = momentum * (local_lr_prev / local_lr) * b + d``,
``w -= local_lr * b``: exactly torch's fused SGD kernel with a per-tensor
momentum, which updates ``b`` and ``w`` in one pass. ``velocity(p)`` returns
``v`` in Fleet's units.

Kernels, behind one function ``lars(params, grads, states, ..., kernel=)``
(the ``LARS`` class is a shell over it): the reference loop, torch's fused SGD
per tensor (CPU), foreach lists (``multi_tensor``), and Triton (one launch
for the norms of every tensor, one for the updates; ``_triton_steps.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ._base import (
    LayerwiseOptimizer,
    as_state_tensor,
    fusable,
    in_param_order,
    split_runs,
    state_dtype,
)
from ._blocks import blocks, host_norms, whole_squares
from ._norms import any_dtensor, by_device_and_dtype, is_dtensor, local, stack, whole_norms
from ._params import check_range
from ._steps import lars_local_lr, lars_momentum_coefficients, lars_reference_update
from .warm_start import from_sgd

__all__ = ["LARS", "lars"]

# (momentum_buffer, local_lr) of one parameter: the buffer as a local tensor, a 0-d rate.
LarsState = tuple[torch.Tensor, torch.Tensor]


def lars(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
         states: Sequence[LarsState], *, lr: float | torch.Tensor = 1.0, momentum: float = 0.9,
         weight_decay: float = 5e-4, trust_coefficient: float = 1e-3, eps: float = 0.0,
         nesterov: bool = False, trust_clip: bool = False, adapt: bool = True,
         groups: Sequence[tuple[dict, int]] | None = None, kernel: str = "reference",
         ratios: list | None = None, workspace=None,
         found_inf: torch.Tensor | None = None) -> None:
    """One LARS step (the module docstring's update) over tensor lists, in place.

    ``params`` (plain tensors or DTensors), their ``grads``, and ``states``
    (``(momentum_buffer, local_lr)`` per parameter, the buffer in units of
    ``local_lr``; both updated). The keywords hold one group's hyperparameters
    (``adapt``: apply the trust ratio); or ``groups`` lists ``(options, count)``
    runs covering ``params`` in order, ``options`` keyed like the keywords, so
    several param groups share one step (one collective for all norms).

    ``kernel``: ``"reference"``, ``"per_tensor"``, ``"multi_tensor"`` or
    ``"triton"`` (see ``LayerwiseOptimizer``). The ratios ``local_lr / lr`` are
    appended to ``ratios`` in parameter order when it is a list. ``workspace``:
    a dict for the Triton kernel's tables, kept by the caller between steps.
    ``found_inf``: a 0-d overflow flag (``torch.amp.GradScaler``'s): where it is
    nonzero the step changes nothing. The Triton kernel reads it on the device; the
    other kernels read it to the host first.

    Non-finite values, alike in every kernel (the reference's rule): an infinite
    gradient element gives its tensor an infinite norm and so ``local_lr = 0``; that
    gradient then adds nothing (the velocity only decays, as at lr 0). A nan gradient,
    or an inf or nan weight, makes that tensor nan.
    """
    if groups is None:
        groups = [(dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        trust_clip=trust_clip, adapt=adapt), len(params))]
    runs = split_runs(groups, params, grads, states)
    if kernel == "triton":
        from ._triton_steps import lars_triton

        lars_triton(runs, ratios, workspace, found_inf)
        return
    if found_inf is not None and bool(found_inf):
        return
    if kernel not in ("reference", "per_tensor", "multi_tensor"):
        raise ValueError(f"lars: kernel={kernel!r} should be 'reference', 'per_tensor', "
                         "'multi_tensor' or 'triton'")
    if kernel == "per_tensor" and not any(is_dtensor(w) for w in params):
        for run in runs:
            _per_tensor_group(*run, ratios)
        return
    _with_norms_first(runs, kernel, ratios)


class LARS(LayerwiseOptimizer):
    """LARS: momentum SGD with a per-layer learning rate from the trust ratio.

    Args:
        params: ``model.named_parameters()`` (needed for ``exclude``), plain
            parameters, or param groups with per-group overrides.
        lr: global learning rate (scheduled as usual through ``param_groups``).
            The default 1.0 follows timm's ``Lars``: in scaling mode the step is
            ``lr * trust_coefficient * ||w|| / ||g||``-sized, so the trust
            coefficient, not ``lr``, sets its scale. A float, or a 0-d tensor
            (the multi-tensor and Triton kernels then never read it to the host).
        momentum: momentum ``mu`` in ``[0, 1)``.
        weight_decay: Fleet ``lars_weight_decay``; part of the trust ratio.
        trust_coefficient: Fleet ``lars_coeff``.
        eps: Fleet ``epsilon``, added to the trust-ratio denominator.
        nesterov: Nesterov momentum.
        exclude: parameter-name substrings (Fleet ``exclude_from_weight_decay``,
            e.g. ``("bn", "bias")``); matching parameters take a plain
            momentum-SGD step: no weight decay and no trust ratio.
        trust_clip: LARC's clipping mode: ``local_lr = min(adaptive, lr)``
            instead of ``lr * adaptive`` (NVIDIA apex ``LARC(clip=True)``).
        always_adapt: keep the trust ratio for excluded parameters too.
        fast: ``False`` forces the per-tensor reference kernel (as
            ``kernel="reference"``).
        kernel: ``"auto"``, ``"reference"``, ``"per_tensor"``, ``"multi_tensor"``
            or ``"triton"``; see ``LayerwiseOptimizer``.
    """

    _name = "LARS"
    _state_keys = ("momentum_buffer", "local_lr")
    _warm_start = (from_sgd, "a momentum buffer (momentum_buffer: SGD with momentum, timm's Lars)")

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1.0, momentum: float = 0.9,
                 weight_decay: float = 5e-4, trust_coefficient: float = 1e-3,
                 eps: float = 0.0, nesterov: bool = False, exclude: Sequence[str] = (),
                 trust_clip: bool = False, always_adapt: bool = False,
                 fast: bool | None = None, kernel: str = "auto"):
        if not isinstance(lr, torch.Tensor):
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
        super().__init__(params, defaults, exclude, fast, kernel)

    def velocity(self, p: torch.Tensor) -> torch.Tensor | None:
        """Fleet's velocity ``v`` for parameter ``p`` (None before its first step)."""
        state = self.state.get(p)
        if not state:
            return None
        return state["momentum_buffer"] * state["local_lr"]

    def _state(self, w: torch.Tensor, kernel: str = "") -> LarsState:
        """(momentum buffer's local tensor, local_lr as a 0-d tensor of its dtype) for ``w``."""
        state = self.state[w]
        if not state:
            # zeros_like keeps a dense parameter's strides (and a DTensor's placements).
            state["momentum_buffer"] = torch.zeros_like(w, dtype=state_dtype(w, kernel))
            state["local_lr"] = 0.0
        b = local(state["momentum_buffer"])
        state["local_lr"] = prev = as_state_tensor(state["local_lr"], b)
        return b, prev

    def _stored(self, w: torch.Tensor) -> LarsState | None:
        """``w``'s state as stored, or None before its first step or while ``local_lr``
        is still an old state dict's Python float."""
        state = self.state.get(w)
        if state and type(state["local_lr"]) is torch.Tensor:
            return state["momentum_buffer"], state["local_lr"]
        return None

    def _plain_state(self, w: torch.Tensor, kernel: str) -> LarsState:
        """``_state`` for a tensor known not to be a DTensor, with the lookups short."""
        state = self.state[w]
        if state:
            prev = state["local_lr"]
            b = state["momentum_buffer"]
            if type(prev) is torch.Tensor and prev.dtype == b.dtype and prev.device == b.device:
                return b, prev
        return self._state(w, kernel)

    def _update(self, work, kernel, ratios, found_inf=None):
        params = [w for _, ps in work for w in ps]
        sharded = any_dtensor(params)
        if kernel == "triton" and not sharded:  # the kernels check devices themselves
            states = [self._stored(w) or self._state(w, kernel) for w in params]
        else:
            states = [self._state(w, kernel) if sharded else self._plain_state(w, kernel)
                      for w in params]
        lars(params, [w.grad for w in params], states,
             groups=[({**g, "adapt": self._adapts(g)}, len(ps)) for g, ps in work],
             kernel=kernel, ratios=ratios, workspace=self._workspace, found_inf=found_inf)


def _with_norms_first(runs, kernel: str, ratios: list | None) -> None:
    """The norms of every adapted tensor first, reduced together (one collective per
    step), then the updates: the reference loop, foreach lists (``multi_tensor``), or
    fused SGD per local shard (``per_tensor`` on DTensor shards)."""
    adapted = [(w, g) for opts, ps, gs, _ in runs if opts["adapt"]
               for w, g in zip(ps, gs, strict=True)]
    ws = [w for w, _ in adapted]
    if kernel == "per_tensor":  # DTensor shards on CPU: BLAS dots, one host read
        squares = whole_squares([local(t) for t in ws + [g for _, g in adapted]], ws + ws)
        norms = [math.sqrt(x) for x in squares]
    else:
        norms = whole_norms(ws + [g for _, g in adapted], ws + ws)
    w_norms = dict(zip(map(id, ws), norms[: len(ws)], strict=True))
    g_norms = dict(zip(map(id, ws), norms[len(ws):], strict=True))
    for opts, params, grads, states in runs:
        if kernel == "multi_tensor":
            buckets = by_device_and_dtype(params)
            parts = [_multi_tensor(opts, *([seq[i] for i in idx] for seq in (params, grads, states)),
                                   w_norms, g_norms)
                     for idx in buckets]
            if ratios is not None:
                ratios.extend(in_param_order(buckets, parts))
            continue
        lr = float(opts["lr"])
        adapt = opts["adapt"]
        if adapt and kernel == "per_tensor":  # the norms are Python floats
            local_lrs = [lars_local_lr(lr, opts["trust_coefficient"], w_norms[id(w)],
                                       g_norms[id(w)], opts["weight_decay"], opts["eps"],
                                       opts["trust_clip"]) for w in params]
        elif adapt:
            group_norms = ([w_norms[id(w)] for w in params], [g_norms[id(w)] for w in params])
            local_lrs = _local_lrs(opts, params, group_norms).tolist()
        else:
            local_lrs = [lr] * len(params)
        # reference, or fused kernels on DTensor shards
        update = _fused_update if kernel == "per_tensor" else lars_reference_update
        for w, g, (b, prev_t), local_lr in zip(params, grads, states, local_lrs, strict=True):
            prev_t.fill_(update(local(w), local(g), b, local_lr, prev_t.item(),
                                opts["momentum"], opts["weight_decay"], opts["nesterov"]))
            if ratios is not None:
                ratios.append(local_lr / lr if adapt and lr > 0 else 1.0)


def _local_lrs(opts, params, norms) -> torch.Tensor:
    """Every tensor's ``local_lr`` in ``params`` as one 1-d tensor."""
    lr = opts["lr"]
    like = local(params[0])
    if norms is None:  # not adapted: the global rate
        return torch.zeros(len(params), dtype=like.dtype, device=like.device) + lr
    w_norms, g_norms = norms
    return lars_local_lr(lr, opts["trust_coefficient"], stack(w_norms), stack(g_norms),
                         opts["weight_decay"], opts["eps"], opts["trust_clip"])


def _per_tensor_group(opts, params, grads, states, ratios) -> None:
    """One group of plain tensors, a cache-sized block at a time (see ``_blocks``).

    Per block: the norms of ``w`` and ``g`` (``host_norms``) and the stored
    ``local_lr`` values, read to the host together; ``lars_local_lr`` on
    Python floats; then torch's fused SGD tensor by tensor while the block
    is still in cache (the reference update where it cannot apply).
    """
    lr = float(opts["lr"])
    adapt = opts["adapt"]
    mu, wd, nesterov = opts["momentum"], opts["weight_decay"], opts["nesterov"]
    coeff, eps, clip = opts["trust_coefficient"], opts["eps"], opts["trust_clip"]
    for idx in blocks(params):
        block = [params[i] for i in idx]
        prev_ts = [states[i][1] for i in idx]
        k = len(block)
        if adapt:
            n, prevs = host_norms(block + [grads[i] for i in idx], prev_ts)
            local_lrs = [lars_local_lr(lr, coeff, wn, gn, wd, eps, clip)
                         for wn, gn in zip(n[:k], n[k:], strict=True)]
        else:
            prevs = torch.stack(prev_ts).tolist()
            local_lrs = [lr] * k
        units = [_fused_update(params[i], grads[i], states[i][0], local_lr, prev, mu, wd, nesterov)
                 for i, local_lr, prev in zip(idx, local_lrs, prevs, strict=True)]
        torch._foreach_copy_(prev_ts, torch.tensor(units, dtype=prev_ts[0].dtype).unbind())
        if ratios is not None:
            ratios.extend(x / lr if adapt and lr > 0 else 1.0 for x in local_lrs)


def _fused_update(w, g, b, local_lr: float, prev: float, momentum: float,
                  weight_decay: float, nesterov: bool) -> float:
    """``lars_reference_update`` by torch's fused SGD kernel where it applies
    (same layouts, ``local_lr > 0``, no Nesterov); returns the buffer's new unit."""
    if local_lr and not nesterov and fusable(w, g, b):
        carry = momentum * prev / local_lr
        # The kernel wants momentum > 0; with carry 0 its first-step mode sets b = d.
        torch._fused_sgd_([w], [g], [b], weight_decay=weight_decay, momentum=carry or 1.0,
                          lr=local_lr, dampening=0.0, nesterov=False, maximize=False,
                          is_first_step=carry == 0.0)
        return local_lr
    return lars_reference_update(w, g, b, local_lr, prev, momentum, weight_decay, nesterov)


def _multi_tensor(opts, params, grads, states, w_norms, g_norms) -> torch.Tensor:
    """One (device, dtype) bucket with foreach ops; nothing read to the host.

    Returns the bucket's trust ratios ``local_lr / lr`` (1 where lr is 0).
    """
    mu, wd, lr = opts["momentum"], opts["weight_decay"], opts["lr"]
    bufs = [b for b, _ in states]
    ws = [local(w) for w in params]
    gs = [local(g) for g in grads]
    norms = ([w_norms[id(w)] for w in params], [g_norms[id(w)] for w in params]) \
        if opts["adapt"] else None
    local_lr = _local_lrs(opts, params, norms)
    unit, carry, d_coef = lars_momentum_coefficients(
        local_lr, torch.stack([p for _, p in states]), mu)
    ds = torch._foreach_add(gs, ws, alpha=wd) if wd else gs
    # Where local_lr is 0 (an infinite gradient norm, or lr 0) d adds nothing, as in the
    # reference: clamped to 0 there, since d_coef * d would be 0 * inf = nan.
    bound = torch.where(d_coef == 0, 0.0, math.inf).to(local_lr.dtype)
    ds = torch._foreach_clamp_max(ds, bound.unbind())
    torch._foreach_clamp_min_(ds, (-bound).unbind())
    torch._foreach_mul_(bufs, carry.unbind())
    torch._foreach_add_(bufs, ds)
    if opts["nesterov"]:
        torch._foreach_addcmul_(ws, bufs, (-mu * unit).unbind())
        torch._foreach_addcmul_(ws, ds, (-local_lr).unbind())
    else:
        torch._foreach_addcmul_(ws, bufs, (-unit).unbind())
    torch._foreach_copy_([p for _, p in states], unit.unbind())
    if norms is None:
        return torch.ones_like(local_lr)
    if isinstance(lr, torch.Tensor):
        return torch.where(lr == 0, 1.0, local_lr / lr)
    return local_lr / lr if lr > 0 else torch.ones_like(local_lr)
