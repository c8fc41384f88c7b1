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
from bigbatch.optim._norms import local
from bigbatch.optim.clip import clip_grads_

__all__ = ["align_grads", "grad_norm", "normalize", "optimizer_step", "statistics", "unscale"]


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def align_grads(named: list[tuple[str, torch.Tensor]]) -> None:
    """Tensor parallelism: give every gradient its parameter's layout before any norm or
    step. An untied vocabulary-parallel embedding's gradient comes back replicated while
    its weight is sharded; redistributing to the weight's placements is a local slice."""
    from torch.distributed.tensor import DTensor

    for name, p in named:
        g = p.grad
        if g is None or not isinstance(p, DTensor):
            continue
        if not isinstance(g, DTensor) or g.shape != p.shape:
            raise RuntimeError(f"the gradient of {name} ({type(g).__name__} of shape "
                               f"{tuple(g.shape)}) does not match the parameter "
                               f"({tuple(p.shape)})")
        if g.placements != p.placements or g.device_mesh != p.device_mesh:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def normalize(window: MergeWindow, params: list[torch.Tensor], data_degree: int) -> None:
    """``count=`` losses: divide the reduced gradients by the step's total item count."""
    if window.mode != "count":
        return
    grads = [local(g) for g in _grads(params)]
    if grads:
        torch._foreach_mul_(grads, window.grad_factor(data_degree))


def unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """fp16: unscale the gradients in place; True when one is inf or nan (skip the step)."""
    return scaler.unscale_(optimizer) if scaler is not None else False


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


def optimizer_step(optimizer: torch.optim.Optimizer,
                   named: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
    """`optimizer.step()`; an error from inside it names the parameters whose gradient
    does not fit them (`named()` lists the model's parameters, read only on that path)."""
    try:
        optimizer.step()
    except RuntimeError as e:
        bad = [f"{n} (weight {tuple(p.shape)}, gradient {tuple(p.grad.shape)})"
               for n, p in named() if p.grad is not None and p.grad.shape != p.shape]
        if not bad:
            raise
        raise RuntimeError(f"optimizer step: {str(e).splitlines()[0]}; gradient shapes "
                           f"differ from their parameters: {', '.join(bad[:3])}") from e
