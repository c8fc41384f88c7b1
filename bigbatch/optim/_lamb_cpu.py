"""LAMB's per-tensor kernel for CPU: fused Adam into a scratch buffer, in cache-sized chunks.

A two-pass LAMB must move at least 40 bytes per fp32 parameter (AdamW: 28):
the first pass reads ``g, m, v, w`` and writes ``m, v, u``; the second reads
``w, u`` and writes ``w``. Written as whole-tensor torch calls it moves more,
because ``u += weight_decay * w`` and the two norms each sweep memory again.
Here the first pass runs chunk by chunk: torch's fused Adam kernel writes a
chunk of ``r`` into the scratch buffer, then the weight decay and the chunk's
squared norms of ``w`` and ``u`` are taken while both chunks are still in
cache (dot products, ``_blocks.norms``), and the trust ratio on Python
floats (one host read per tensor: free on CPU). Only then, with the whole norms known, does ``w -= lr * ratio * u``
sweep the tensor once more.

The fused kernel walks raw memory, so all tensors it gets must be dense with
one layout: the scratch is viewed with ``w``'s strides (transposed and
``channels_last`` weights included) and the chunks are slices of memory
order, which pairs the same elements in every tensor. A tensor whose layout
does not fit (a non-dense view, a gradient laid out unlike the parameter)
takes the readable reference kernel instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._base import fusable
from ._blocks import memory_order, norms
from ._steps import adam_direction, lamb_trust_ratio, no_bias_correction_step

# Elements per chunk: five fp32 arrays of this size (g, m, v, u, w) stay within
# a typical L2 + L3 slice, while a chunk is large enough that per-call overhead
# stays small against its memory time.
CHUNK = 1 << 18


class LambScratch:
    """One flat update buffer reused by every tensor.

    ``largest(dtype, device)`` gives the size to allocate: the optimizer's
    largest parameter of that kind, so the buffer is allocated once.
    """

    def __init__(self, largest: Callable[[torch.dtype, torch.device], int]):
        self.largest = largest
        self.buffer: torch.Tensor | None = None

    def like(self, w: torch.Tensor) -> torch.Tensor:
        """A view of the buffer with ``w``'s shape and (dense) strides."""
        s = self.buffer
        if s is None or s.numel() < w.numel() or s.dtype != w.dtype or s.device != w.device:
            size = max(w.numel(), self.largest(w.dtype, w.device))
            s = self.buffer = torch.empty(size, dtype=w.dtype, device=w.device)
        return s.as_strided(w.shape, w.stride())


def lamb_step_per_tensor(scratch: LambScratch, group: dict, w: torch.Tensor,
                         step: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                         adapt: bool) -> float:
    """One LAMB step of one plain tensor (``step`` already counts it); returns the ratio."""
    beta1, beta2 = group["betas"]
    wd, eps, lr = group["weight_decay"], group["eps"], float(group["lr"])
    g = w.grad
    if not fusable(w, g, m, v):
        u = torch.empty_like(m)
        adam_direction(u, g, m, v, beta1, beta2, eps,
                       int(step.item()) if group["bias_correction"] else None)
        if wd:
            u.add_(w, alpha=wd)
        if adapt:
            w_norm, u_norm = norms([w, u]).tolist()
    else:
        u = scratch.like(w)
        count = step if group["bias_correction"] else no_bias_correction_step(w.device)
        parts: list[torch.Tensor] = []
        for uc, gc, mc, vc, wc in _chunks(u, g, m, v, w):
            # u starts as weight_decay * w; the fused kernel then adds r
            # (lr = -1 on the "parameter" u), so u = r + weight_decay * w in one sweep.
            if wd:
                torch.mul(wc, wd, out=uc)
            else:
                uc.zero_()
            torch._fused_adam_([uc], [gc], [mc], [vc], [], [count], lr=-1.0, beta1=beta1,
                               beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False,
                               maximize=False)
            if adapt:
                parts.append(norms([wc, uc]))
        if adapt:  # the chunks' norms combine as the root of their sum of squares
            both = parts[0] if len(parts) == 1 else torch.stack(parts).square().sum(0).sqrt()
            w_norm, u_norm = both.tolist()
    ratio = lamb_trust_ratio(w_norm, u_norm, group["trust_clip"]) if adapt else 1.0
    w.sub_(u, alpha=lr * ratio)
    return ratio


def _chunks(*tensors: torch.Tensor):
    """Matching memory-order chunks of same-layout dense tensors (whole when small)."""
    n = tensors[0].numel()
    if n <= CHUNK:
        yield tensors
        return
    flat = [memory_order(t) for t in tensors]
    for start in range(0, n, CHUNK):
        yield tuple(t[start:start + CHUNK] for t in flat)
