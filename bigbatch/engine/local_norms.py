"""Where the `[adaptive]` controller's small-batch gradient norms come from.

`install_local_norms(window, comm, ...)` measures each worker's gradient norm before the
all-reduce inside the engine's DDP comm hook (one scalar per worker) and, for
AdamW / LAMB, preconditions gradients as ``g / (sqrt(v_hat) + eps)`` first
(`preconditioned_grads`). Used by `bigbatch.engine.adaptive`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from bigbatch.adaptive.norms import param_group_of, preconditioned_grads, sq_norm

__all__ = ["install_local_norms", "param_group_of", "preconditioned_grads", "tensor_sq_norms"]

if TYPE_CHECKING:
    from bigbatch.engine.merge import MergeWindow


def tensor_sq_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Squared norm of each tensor as one float64 vector (a few ops, any dtypes)."""
    acc = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = torch._foreach_norm(list(tensors), 2, dtype=acc)
    return torch.stack(norms).to(torch.float64).square()


def install_local_norms(window: MergeWindow, comm: Any, optimizer: torch.optim.Optimizer,
                        params: list[torch.Tensor], device: torch.device,
                        preconditioned: bool) -> None:
    """Small-batch norms: preconditioned for Adam/LAMB, and independent of DDP's buckets.

    DDP regroups its buckets after the first step of every run, so a sum over
    buckets would change its rounding after a resume. Each parameter's squared
    norm goes to its own slot of a vector summed in parameter order.
    """
    opt = optimizer
    if preconditioned:  # one worker with merge: the first micro-step's norm
        window.measure_first_with(lambda ps: sq_norm(
            preconditioned_grads(opt, ps, [p.grad for p in ps])))
    if comm is None or not comm.measure_local:
        return
    index = {id(p): i for i, p in enumerate(params)}
    slots = torch.zeros(len(params), dtype=torch.float64, device=device)
    where: dict[tuple[int, ...], torch.Tensor] = {}  # bucket's parameters -> their slots
    inner, inner_state = comm.inner, comm.inner_state

    def hook(_state: Any, bucket: Any) -> Any:
        # Before the inner hook divides or reduces the bucket in place (still loss-scaled).
        if comm.local_sq is None:  # taken by the engine: a new optimizer step
            slots.zero_()
        params, grads = bucket.parameters(), bucket.gradients()
        key = tuple(index[id(p)] for p in params)
        if key not in where:
            where[key] = torch.tensor(key, dtype=torch.long, device=slots.device)
        pre = preconditioned_grads(opt, params, grads) if preconditioned else grads
        slots.index_copy_(0, where[key], tensor_sq_norms(pre))
        comm.local_sq = slots.sum()
        return inner(inner_state, bucket)

    comm.measure_local = False  # the engine's per-bucket sum is replaced by `hook`
    comm.inner, comm.inner_state = hook, None
