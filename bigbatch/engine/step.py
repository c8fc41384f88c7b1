"""The optimizer step as named stages, each a function of the parts it needs.

    align -> normalize -> unscale (non-finite check) -> statistics -> clip -> optimizer step
    -> schedule

`Run` calls them in that order once the merge window's gradients are reduced
(`Run._finish_step`); every gradient statistic (hooks, the logged norm,
clipping) sees unscaled gradients in the optimizer's units.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bigbatch.engine.grad_info import GradInfo, sq_norm
from bigbatch.engine.merge import MergeWindow
from bigbatch.optim import layouts
from bigbatch.optim._norms import local
from bigbatch.optim.clip import clip_grads_

__all__ = ["align_grads", "grad_norm", "normalize", "optimizer_step", "overflow", "statistics",
           "takes_overflow_flag", "unscale"]


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def align_grads(named: list[tuple[str, torch.Tensor]]) -> None:
    """Tensor parallelism: give every gradient its parameter's layout before any norm or
    step (`bigbatch.optim.layouts`, the same function the optimizers call in their own
    step). An untied vocabulary-parallel embedding's gradient comes back replicated while
    its weight is sharded; redistributing to the weight's placements is a local slice."""
    layouts.align_grads(named)


def normalize(window: MergeWindow, params: list[torch.Tensor], data_degree: int) -> None:
    """``count=`` losses: divide the reduced gradients by the step's total item count."""
    if window.mode != "count":
        return
    grads = [local(g) for g in _grads(params)]
    if grads:
        torch._foreach_mul_(grads, window.grad_factor(data_degree))


def unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """fp16: unscale the gradients in place; the overflow flag (a device tensor, 1 when
    one is inf or nan: skip the step), None without a loss scaler."""
    return scaler.unscale_(optimizer) if scaler is not None else None


def overflow(found_inf: torch.Tensor | None, on_device: bool
             ) -> tuple[torch.Tensor | None, bool]:
    """fp16: (the flag for the optimizer to skip on the device, whether the step is
    skipped here). `on_device` (`Run.device_skip`): the flag goes to the optimizer and is
    never read; else it is read (one host sync) and an overflow skips the whole step."""
    if found_inf is None:
        return None, False
    if on_device:
        return found_inf, False
    return None, bool(found_inf)


def takes_overflow_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours ``optimizer.found_inf`` (the protocol torch's
    GradScaler uses) by skipping the update on the device: torch's fused kernels,
    bigbatch's LARS/LAMB (whose Triton kernel skips on the device; the others read it)
    and Muon (which chooses each new value by the flag on the device)."""
    from bigbatch.optim._base import LayerwiseOptimizer
    from bigbatch.optim.muon import Muon

    if isinstance(optimizer, (LayerwiseOptimizer, Muon)):
        return True
    fused = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))
    if not fused or not optimizer.defaults.get("fused"):
        return False
    # See `_zero_momentum_before_first_step`.
    return not any(g.get("momentum") and g.get("dampening") for g in optimizer.param_groups)


def statistics(hooks: list[Callable[[GradInfo], None]],
               make_info: Callable[[], GradInfo]) -> GradInfo | None:
    """Run the gradient hooks (noise scale, AdaScale, K-FAC) on this step's `GradInfo`."""
    if not hooks:
        return None
    info = make_info()
    for hook in hooks:
        hook(info)
    return info


def grad_norm(params: list[torch.Tensor], info: GradInfo | None = None,
              pipeline: Any = None) -> torch.Tensor:
    """The whole model's gradient norm (a 0-d tensor): over a pipeline's stages, from the
    hooks' `GradInfo` when they measured it, else from the gradients."""
    if pipeline is not None:
        sq = pipeline.grad_sq_norm()
    elif info is not None:
        sq = info.global_sq_norm()
    else:
        sq = sq_norm(_grads(params))
    return sq.sqrt()


def clip(params: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Clip the global gradient norm to `max_norm` (`bigbatch.optim.clip`)."""
    clip_grads_(_grads(params), norm, max_norm)


def _zero_momentum_before_first_step(optimizer: torch.optim.Optimizer) -> None:
    """torch's fused SGD makes its momentum buffers with ``empty_like`` on the first step
    and fills them in the kernel, which a set overflow flag skips: a skipped first step
    would leave them uninitialised. Zero buffers give the same first step (``b = g``)
    when ``dampening`` is 0, whether or not that step is skipped."""
    if optimizer.state or not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"] and not group["dampening"]:
            for p in group["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def optimizer_step(optimizer: torch.optim.Optimizer,
                   named: Callable[[], list[tuple[str, torch.Tensor]]],
                   found_inf: torch.Tensor | None = None) -> None:
    """`optimizer.step()`, told the overflow flag `found_inf` when given (skip on the
    device; see `takes_overflow_flag`); an error from inside it names the parameters
    whose gradient does not fit them (`named()` lists the model's parameters, read only
    on that path)."""
    try:
        if found_inf is None:
            optimizer.step()
        else:
            _zero_momentum_before_first_step(optimizer)
            optimizer.found_inf, optimizer.grad_scale = found_inf, None
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale
    except RuntimeError as e:
        bad = [f"{n} (weight {tuple(p.shape)}, gradient {tuple(p.grad.shape)})"
               for n, p in named() if p.grad is not None and p.grad.shape != p.shape]
        if not bad:
            raise
        raise RuntimeError(f"optimizer step: {str(e).splitlines()[0]}; gradient shapes "
                           f"differ from their parameters: {', '.join(bad[:3])}") from e
