"""Global gradient-norm clipping, written once: the engine's ``max_grad_norm`` and
LAMB's (NVIDIA's pre-normalisation) both call `clip_grads_`.

``g <- g * max_norm / max(||g||, max_norm)``: a no-op below the bound, the
gradient scaled onto the bound above it (``torch.nn.utils.clip_grad_norm_``'s
rule without its epsilon). The factor stays a device tensor: no host sync.
"""

from __future__ import annotations

import torch

from ._norms import local

__all__ = ["clip_factor", "clip_grads_"]


def clip_factor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``max_norm / max(total_norm, max_norm)``, a 0-d tensor on `total_norm`'s device."""
    # new_full fills on the device (as_tensor would copy from the host: a CUDA sync).
    limit = total_norm.new_full((), max_norm)
    return limit / torch.maximum(total_norm, limit)


def clip_grads_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` in place so that their global norm `total_norm` is at most `max_norm`.

    `grads` may be DTensors (their local shards are scaled) and may mix devices and
    dtypes; `total_norm` is the whole gradient's norm (over every shard).
    """
    if not grads:
        return
    factor = clip_factor(total_norm, max_norm)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        t = local(g)
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), bucket in buckets.items():
        torch._foreach_mul_(bucket, factor.to(device=device, dtype=dtype))
