"""LAMB and LARS steps with the Triton kernels: the launches of one step, in order.

Per step, whatever the number of tensors (a bucket is a param group's tensors
of one dtype pair: usually one or two buckets), two launches per bucket:

- LAMB: [clipping: ``sum_squares`` per bucket, ``reduce_chunks``, one sum];
  ``lamb_moments`` (moments, partial norms) then ``lamb_update`` per bucket.
- LARS: ``lars_norms`` (partial norms) then ``lars_update`` per bucket.

DTensor parameters (FSDP2, tensor parallel): the kernels run on the local
shards; between the passes ``reduce_chunks`` sums every tensor's partial norms
and ``_norms.sum_over_shards`` sums those over the mesh, for all tensors
together: one all-reduce per step (one more for LAMB's global clipping), as
in the other kernels.

Nothing is read to the host and no Python branch depends on a tensor's value:
the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from . import _triton_plan as plan
from ._norms import sum_over_shards


def lamb_triton(runs, max_grad_norm: float | None, ratios: list | None,
                workspace: dict | None, found_inf: torch.Tensor | None = None) -> None:
    """LAMB over ``runs`` = ``(opts, params, grads, states)`` per group, states
    ``(step, exp_avg, exp_avg_sq)``; see ``lamb.lamb`` for the update. A set
    ``found_inf`` flag makes the step change nothing (read by the kernels)."""
    clip = max_grad_norm is not None
    # Rows w, g, step, m, v; m and v, like w and g, walked elementwise.
    step = plan.prepare(workspace, runs, streamed=(0, 1, 3, 4), state_row=3,
                        written=(0, 3, 4) + ((1,) if clip else ()))
    k = plan.kernels(step.device)
    lay = step.layout
    tables = (step.ptrs, step.n, lay.chunk_tensor, lay.chunk_start, lay.numel)
    sizes = dict(CHUNK=plan.CHUNK, BLOCK=plan.BLOCK)
    total = lay.squares  # a placeholder pointer unless clipping
    found, skip = _flag(found_inf, step)
    if clip:
        partials, squares = lay.grad_partials(), lay.grad_squares()
        for b in step.buckets:
            plan.launch(k.sum_squares, b.chunks, *tables, partials, b.chunk0, 1,
                        W=k.dtype(b.weight_dtype), C=_compute(k, b), ALIGN=b.align, **sizes)
        plan.launch(k.reduce_chunks, step.n, partials, lay.first_chunk, squares, K=1,
                    RBLOCK=plan.REDUCE_BLOCK)
        if step.sharded:
            sum_over_shards(squares, step.owners)
        total = squares.sum()
    for b in step.buckets:
        o = b.opts
        beta1, beta2 = o["betas"]
        plan.launch(k.lamb_moments, b.chunks, *tables, lay.partials, lay.scalars, b.chunk0,
                    total, float(beta1), float(beta2), _log(beta1), _log(beta2),
                    float(o["eps"]), float(o["weight_decay"]), float(max_grad_norm or 0.0),
                    found, W=k.dtype(b.weight_dtype), S=k.dtype(b.state_dtype),
                    C=_compute(k, b), BIAS=bool(o["bias_correction"]), NORMS=bool(o["adapt"]),
                    CLIP=clip, SKIP=skip, ALIGN=b.align, **sizes)
    summed = _sum_norms_over_shards(k, step)
    out = _ratios(step, ratios)
    for b in step.buckets:
        o = b.opts
        beta1, beta2 = o["betas"]
        lr_ptr, lr_value, lr_is_ptr = _rate(o["lr"], step)
        plan.launch(k.lamb_update, b.chunks, *tables, lay.first_chunk, lay.partials,
                    lay.squares, lay.scalars, b.chunk0, lr_ptr, lr_value, _log(beta1),
                    _log(beta2), float(o["eps"]), float(o["weight_decay"]), out,
                    lay.positions, found, W=k.dtype(b.weight_dtype), S=k.dtype(b.state_dtype),
                    C=_compute(k, b), BIAS=bool(o["bias_correction"]), ADAPT=bool(o["adapt"]),
                    TRUST_CLIP=bool(o["trust_clip"]), SUMMED=summed, LR_PTR=lr_is_ptr,
                    SKIP=skip, RBLOCK=plan.REDUCE_BLOCK, **sizes, ALIGN=b.align)
    step.copy_back()


def lars_triton(runs, ratios: list | None, workspace: dict | None,
                found_inf: torch.Tensor | None = None) -> None:
    """LARS over ``runs`` = ``(opts, params, grads, states)`` per group, states
    ``(momentum_buffer, local_lr)``; see ``lars.lars`` for the update. A set
    ``found_inf`` flag makes the step change nothing (read by the kernels)."""
    # Rows w, g, momentum_buffer, local_lr.
    step = plan.prepare(workspace, runs, streamed=(0, 1, 2), state_row=2, written=(0, 2))
    k = plan.kernels(step.device)
    lay = step.layout
    tables = (step.ptrs, step.n, lay.chunk_tensor, lay.chunk_start, lay.numel)
    sizes = dict(CHUNK=plan.CHUNK, BLOCK=plan.BLOCK)
    found, skip = _flag(found_inf, step)
    for b in step.buckets:
        plan.launch(k.lars_norms, b.chunks, *tables, lay.partials, lay.scalars, b.chunk0,
                    W=k.dtype(b.weight_dtype), S=k.dtype(b.state_dtype), C=_compute(k, b),
                    NORMS=bool(b.opts["adapt"]), ALIGN=b.align, **sizes)
    summed = _sum_norms_over_shards(k, step)
    out = _ratios(step, ratios)
    for b in step.buckets:
        o = b.opts
        lr_ptr, lr_value, lr_is_ptr = _rate(o["lr"], step)
        plan.launch(k.lars_update, b.chunks, *tables, lay.first_chunk, lay.partials,
                    lay.squares, lay.scalars, b.chunk0, lr_ptr, lr_value, float(o["momentum"]),
                    float(o["weight_decay"]), float(o["trust_coefficient"]), float(o["eps"]),
                    out, lay.positions, found, W=k.dtype(b.weight_dtype),
                    S=k.dtype(b.state_dtype), C=_compute(k, b), ADAPT=bool(o["adapt"]),
                    TRUST_CLIP=bool(o["trust_clip"]), NESTEROV=bool(o["nesterov"]),
                    SUMMED=summed, LR_PTR=lr_is_ptr, SKIP=skip, RBLOCK=plan.REDUCE_BLOCK,
                    **sizes, ALIGN=b.align)
    step.copy_back()


def _sum_norms_over_shards(k, step: plan.Step) -> bool:
    """DTensor shards: every tensor's two squared norms summed over its chunks
    (``reduce_chunks``), then over its mesh, all in one call; returns whether the
    second pass should read them from ``squares`` (else it sums the chunks itself)."""
    if not step.sharded:
        return False
    lay = step.layout
    plan.launch(k.reduce_chunks, step.n, lay.partials, lay.first_chunk, lay.squares, K=2,
                RBLOCK=plan.REDUCE_BLOCK)
    sum_over_shards(lay.squares, [w for w in step.owners for _ in range(2)])
    return True


def _ratios(step: plan.Step, ratios: list | None) -> torch.Tensor:
    """Where the trust ratios go: a fresh tensor appended to ``ratios`` (in the callers'
    order), or the layout's buffer when nobody reads them."""
    if ratios is None:
        return step.layout.ratios
    out = torch.empty(step.n, dtype=torch.float64, device=step.device)
    ratios.append(out)
    return out


def _rate(lr, step: plan.Step) -> tuple[torch.Tensor, float, bool]:
    """(pointer, value, whether to read the pointer) for a float or tensor learning rate.

    A 0-d tensor on the parameters' device is read by the kernels (a scheduler may
    change it between graph replays); one on the CPU is read here, which does not
    wait for the device.
    """
    if isinstance(lr, torch.Tensor):
        if lr.device == step.device:
            return lr, 0.0, True
        if lr.device.type == "cpu":
            return step.layout.squares, float(lr), False
        return lr.to(step.device), 0.0, True
    return step.layout.squares, float(lr), False


def _flag(found_inf: torch.Tensor | None, step: plan.Step) -> tuple[torch.Tensor, bool]:
    """(pointer, whether the kernels read it) for GradScaler's overflow flag: a float32
    0-d tensor on the parameters' device, or a placeholder pointer."""
    if found_inf is None:
        return step.layout.squares, False
    return found_inf.to(step.device, torch.float32).reshape(()), True


def _compute(k, bucket: plan.Bucket):
    """Elementwise arithmetic in float64 for float64 tensors, float32 otherwise."""
    wide = torch.float64 in (bucket.weight_dtype, bucket.state_dtype)
    return k.dtype(torch.float64 if wide else torch.float32)


def _log(beta: float) -> float:
    """``log(beta)`` for the kernels' ``beta^t = exp(t log beta)`` (beta = 0: -inf, so 0)."""
    return math.log(beta) if beta > 0 else -math.inf
