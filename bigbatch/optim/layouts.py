"""Gradients laid out as their parameters, before any norm or update.

Tensor parallelism can hand back a gradient whose DTensor placements differ from its
parameter's: torchtitan's vocabulary-split embedding (``RowwiseParallel`` on an
``nn.Embedding``) has a ``Shard(0)`` weight and a ``Replicate()`` gradient. Every kernel
works on local shards, so such a gradient must first become the parameter's layout;
from a replicated gradient that is a local slice, no communication.

One function does it for the optimizers' ``step`` (LARS, LAMB, Muon used alone under a
user's own plan) and for ``prepare``'s step (``bigbatch.engine.step``), so both name the
same parameter in the same words when a gradient cannot fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ._norms import any_dtensor, dtensor_type

__all__ = ["align_grads", "align_group"]


def align_grads(named: Iterable[tuple[str | None, torch.Tensor]]) -> None:
    """Give every DTensor parameter's gradient the parameter's mesh and placements.

    ``named``: ``(name, parameter)`` pairs (a name may be None). A gradient of another
    shape, or a plain tensor where the parameter is a DTensor, raises naming the
    parameter. Plain parameters are left alone.
    """
    cls = dtensor_type()
    if cls is None:
        return
    for name, p in named:
        g = p.grad
        if g is None or not isinstance(p, cls):
            continue
        if not isinstance(g, cls) or g.shape != p.shape:
            raise RuntimeError(f"the gradient of {name or 'a parameter'} "
                               f"({type(g).__name__} of shape {tuple(g.shape)}) does not "
                               f"match the parameter (DTensor of shape {tuple(p.shape)})")
        if g.placements != p.placements or g.device_mesh != p.device_mesh:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def align_group(group: dict, params: Sequence[torch.Tensor]) -> None:
    """``align_grads`` over one param group's ``params`` that have gradients, named by
    the group's ``param_names`` where it has them. Nothing to do (one type check per
    tensor) when none is a DTensor."""
    if not any_dtensor(params):
        return
    names = dict(zip(map(id, group["params"]), group.get("param_names") or (), strict=False))
    align_grads((names.get(id(p)), p) for p in params)
