"""LAMB's per-tensor kernel for CPU: fused Adam into a scratch buffer, in cache-sized pieces.

A two-pass LAMB must move at least 40 bytes per fp32 parameter (AdamW: 28):
the first pass reads ``g, m, v, w`` and writes ``m, v, u``; the second reads
``w, u`` and writes ``w``. Here the first pass takes ``w``'s squared norm (a
BLAS dot product), which brings ``w`` into cache for the next call:
``u = weight_decay * w`` into a scratch buffer, to which torch's fused Adam
kernel adds ``r`` (so ``u = r + weight_decay * w``); ``u``'s squared norm
follows while ``u`` is in cache. Both are read to the host together (one host
read per tensor: free on CPU) and the trust ratio is taken on Python floats.
Only then, with the whole norms known, does ``w -= lr * ratio * u`` sweep the
tensor once more.

On CPU each of these calls is a parallel region, whose start and join cost
more than cache misses on tensors of a few MiB: such tensors take every
pass whole. Only tensors above ``WHOLE`` elements (embedding tables) run the
first pass chunk by chunk, so that the norms find their chunk in cache.

Small tensors (biases, norm layers, small convolutions: most of a CNN's
tensors, a few per cent of its elements) cost dispatch, not memory. They are
stepped together, a block at a time (``_blocks.blocks``): one fused Adam call
over the block's list, one multi-tensor norm, one host read, two
multi-tensor updates.

The fused kernel walks raw memory, so all tensors it gets must be dense with
one layout: the scratch is viewed with ``w``'s strides (transposed and
``channels_last`` weights included) and the chunks are slices of memory
order, which pairs the same elements in every tensor. A tensor whose layout
does not fit (a non-dense view, a gradient laid out unlike the parameter)
takes the readable reference kernel instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._base import fusable
from ._blocks import SMALL, blocks, host_norms, memory_order, squared_norm
from ._steps import adam_direction, lamb_trust_ratio, no_bias_correction_step

# Tensors up to WHOLE elements take each pass whole; larger ones (embedding
# tables) go in chunks of CHUNK elements, so that the norms and the weight
# decay find their chunk still in cache. Every pass is a parallel region whose
# start and join cost more than the cache saves on tensors of a few MiB:
# chunking ResNet-50's tensors made the step ~5 % slower, while BERT's
# 23 M-element embedding gained ~7 % from 1 M-element chunks (2 threads, 32 MiB L3).
WHOLE = 1 << 22
CHUNK = 1 << 20

# (step, exp_avg, exp_avg_sq) of one parameter.
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LambScratch:
    """One flat update buffer reused by every tensor.

    ``size(dtype, device)`` gives the size to allocate: the most any tensor or
    block of small tensors of that kind needs, so the buffer is allocated once.
    """

    def __init__(self, size: Callable[[torch.dtype, torch.device], int]):
        self.size = size
        self.buffer: torch.Tensor | None = None

    def views(self, ws: list[torch.Tensor]) -> list[torch.Tensor]:
        """Consecutive pieces of the buffer, each with its ``w``'s shape and (dense) strides."""
        first = ws[0]
        total = sum(w.numel() for w in ws)
        s = self.buffer
        if s is None or s.numel() < total or s.dtype != first.dtype or s.device != first.device:
            size = max(total, self.size(first.dtype, first.device))
            s = self.buffer = torch.empty(size, dtype=first.dtype, device=first.device)
        out = []
        offset = 0
        for w in ws:
            out.append(s.as_strided(w.shape, w.stride(), offset))
            offset += w.numel()
        return out


def lamb_group_per_tensor(scratch: LambScratch, group: dict, params: list[torch.Tensor],
                          grads: list[torch.Tensor], states: list[State]) -> list[float]:
    """One LAMB step of one group of plain tensors; returns the trust ratios in order.

    ``group`` holds the hyperparameters (``adapt``: apply the trust ratio).
    Small fusable tensors go together a block at a time, the others one by one.
    """
    adapt = group["adapt"]
    ratios = [1.0] * len(params)
    small, large = [], []
    for i, (w, g, (_, m, v)) in enumerate(zip(params, grads, states, strict=True)):
        (small if w.numel() < SMALL and fusable(w, g, m, v) else large).append(i)
    if large:
        torch._foreach_add_([states[i][0] for i in large], 1)
    for i in large:
        ratios[i] = _one_tensor(scratch, group, params[i], grads[i], *states[i], adapt)
    for run in blocks([params[i] for i in small]):
        idx = [small[j] for j in run]
        block = _block(scratch, group, [params[i] for i in idx], [grads[i] for i in idx],
                       [states[i] for i in idx], adapt)
        for i, ratio in zip(idx, block, strict=True):
            ratios[i] = ratio
    return ratios


def adam_into(us: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor],
              vs: list[torch.Tensor], counts: list[torch.Tensor], group: dict) -> None:
    """``u += r``: torch's fused Adam run on the buffers ``us`` as the "parameters".

    With ``lr = -1`` the kernel's ``param -= lr * m_hat / (sqrt(v_hat) + eps)``
    adds exactly ``r`` to ``u`` (zeroed, or holding ``weight_decay * w``, by the
    caller); it updates the moments on the way.
    """
    beta1, beta2 = group["betas"]
    torch._fused_adam_(us, gs, ms, vs, [], counts, lr=-1.0, beta1=beta1, beta2=beta2,
                       weight_decay=0.0, eps=group["eps"], amsgrad=False, maximize=False)


def direction_into(u: torch.Tensor, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
                   v: torch.Tensor, count: list[torch.Tensor], group: dict) -> None:
    """``u = r + weight_decay * w`` for same-layout dense tensors, moments updated.

    ``u`` starts as ``weight_decay * w``; ``adam_into`` then adds ``r`` in one
    sweep over g, m, v, u.
    """
    if group["weight_decay"]:
        torch.mul(w, group["weight_decay"], out=u)
    else:
        u.zero_()
    adam_into([u], [g], [m], [v], count, group)


def step_counts(group: dict, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the fused kernel gets as the step: the step, or one that skips bias correction."""
    if group["bias_correction"]:
        return steps
    return [no_bias_correction_step(s.device) for s in steps]


def _block(scratch: LambScratch, group: dict, ws: list[torch.Tensor], gs: list[torch.Tensor],
           states: list[State], adapt: bool) -> list[float]:
    """One LAMB step of a block of small same-layout tensors, as multi-tensor calls."""
    steps = [s for s, _, _ in states]
    torch._foreach_add_(steps, 1)
    us = scratch.views(ws)
    torch._foreach_zero_(us)
    adam_into(us, gs, [m for _, m, _ in states], [v for _, _, v in states],
              step_counts(group, steps), group)
    if group["weight_decay"]:
        torch._foreach_add_(us, ws, alpha=group["weight_decay"])
    if adapt:
        values = torch.stack(torch._foreach_norm(ws + us)).tolist()
        k = len(ws)
        ratios = [lamb_trust_ratio(wn, un, group["trust_clip"])
                  for wn, un in zip(values[:k], values[k:], strict=True)]
    else:
        ratios = [1.0] * len(ws)
    lr = float(group["lr"])
    torch._foreach_mul_(us, [-lr * r for r in ratios])
    torch._foreach_add_(ws, us)
    return ratios


def _one_tensor(scratch: LambScratch, group: dict, w: torch.Tensor, g: torch.Tensor,
                step: torch.Tensor, m: torch.Tensor, v: torch.Tensor, adapt: bool) -> float:
    """One LAMB step of one tensor (``step`` already counts it); returns the ratio."""
    beta1, beta2 = group["betas"]
    wd, eps, lr = group["weight_decay"], group["eps"], float(group["lr"])
    if not fusable(w, g, m, v):
        u = torch.empty_like(m)
        adam_direction(u, g, m, v, beta1, beta2, eps,
                       int(step.item()) if group["bias_correction"] else None)
        if wd:
            u.add_(w, alpha=wd)
        if adapt:
            (w_norm, u_norm), _ = host_norms([w, u])
    else:
        (u,) = scratch.views([w])
        count = step_counts(group, [step])
        squares: list[torch.Tensor] = []
        for uc, gc, mc, vc, wc in _chunks(u, g, m, v, w):
            # w's squared norm (a BLAS dot) brings w into cache for the weight decay's
            # read; u's follows the kernel that wrote u. ~7 % off the step against both after.
            if adapt:
                squares.append(squared_norm(wc))
            direction_into(uc, wc, gc, mc, vc, count, group)
            if adapt:
                squares.append(squared_norm(uc))
        if adapt:  # one host read; the chunks' squares add up on the host
            values = torch.stack(squares).tolist()
            w_norm, u_norm = math.sqrt(sum(values[0::2])), math.sqrt(sum(values[1::2]))
    ratio = lamb_trust_ratio(w_norm, u_norm, group["trust_clip"]) if adapt else 1.0
    w.sub_(u, alpha=lr * ratio)
    return ratio


def _chunks(*tensors: torch.Tensor):
    """Matching memory-order chunks of same-layout dense tensors (whole when small)."""
    if tensors[0].numel() <= WHOLE:
        return (tensors,)
    return zip(*(memory_order(t).split(CHUNK) for t in tensors), strict=True)
