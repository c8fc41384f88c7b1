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

from bigbatch.adaptive.gns import sq_norm

if TYPE_CHECKING:
    from bigbatch.engine.merge import MergeWindow


def preconditioned_grads(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                         grads: Sequence[torch.Tensor | None],
                         group_of: dict[int, dict[str, Any]] | None = None) -> list[torch.Tensor]:
    """``g / (sqrt(v_hat) + eps)`` per tensor, as `bigbatch.adaptive.gns.adam_sq_norm` measures it.

    New tensors in the order of `params` (None gradients skipped); parameters
    without Adam state yet stay unpreconditioned. A fixed number of
    (multi-tensor) ops whatever the parameter count, and no host sync. `group_of` (id of
    a parameter -> its param group; default: built from `optimizer`) saves rebuilding that
    map when called per parameter.
    """
    if group_of is None:
        group_of = param_group_of(optimizer)
    out: list[torch.Tensor | None] = []
    at, gs, vs, epss, betas, steps = [], [], [], [], [], []
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        g = g.detach()
        state, group = optimizer.state.get(p, {}), group_of.get(id(p))
        v = state.get("exp_avg_sq")
        if v is None or group is None:
            out.append(g)
            continue
        at.append(len(out))
        out.append(None)
        gs.append(g if g.dtype == torch.float64 else g.float())
        vs.append(v)
        epss.append(float(group.get("eps", 1e-8)))
        betas.append(float(group.get("betas", (0.9, 0.999))[1]))
        # Step 0 (or no bias correction) gives 1 - beta2^0 = 0: no correction below.
        steps.append(state.get("step", 0) if group.get("bias_correction", True) else 0)
    if not gs:
        return out  # type: ignore[return-value]
    device = vs[0].device
    if all(isinstance(t, torch.Tensor) for t in steps):  # may live on the GPU: never read them
        step = torch.stack([t.reshape(()) for t in steps]).to(device, torch.float64)
    else:  # host numbers: one asynchronous copy (a blocking one is a host sync on CUDA)
        step = torch.tensor([float(t) for t in steps], dtype=torch.float64).to(
            device, non_blocking=True)
    beta2 = torch.tensor(betas, dtype=torch.float64).to(device, non_blocking=True)
    bc2 = 1.0 - beta2 ** step
    roots = torch.where(bc2 > 0, bc2.clamp_min(0).sqrt(), 1.0)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, list(roots.unbind()))
    torch._foreach_add_(denom, epss)
    for i, t in zip(at, torch._foreach_div(gs, denom), strict=True):
        out[i] = t
    return out  # type: ignore[return-value]


def param_group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """id of each parameter -> its param group."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


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
