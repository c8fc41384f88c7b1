"""Whole-tensor norms for parameters that may be sharded DTensors.

A trust ratio needs the norm of the *full* parameter. For a DTensor (FSDP2's
``fully_shard``, tensor-parallel plans) each rank holds a shard, so the local
squared norms of every tensor sharded over the same mesh dimensions are
stacked and summed across those dimensions with one ``all_reduce``: one
collective per distinct (mesh, sharded dims) per call, usually exactly one,
never one per tensor. Replicated mesh dimensions are not summed (every rank
already holds the whole tensor there). Plain tensors need no communication.

Nothing is read back to the host: the result stays a tensor, and NCCL's
all-reduce is asynchronous to the host.
"""

from __future__ import annotations

import sys

import torch


def dtensor_type():
    """The DTensor class if anything imported it (else no parameter can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: torch.Tensor) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def any_dtensor(tensors) -> bool:
    """Whether any of ``tensors`` is a DTensor (one lookup of the class for all)."""
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (in-place updates reach the DTensor).

    The shard itself: ``to_local()`` of a ``Parameter(DTensor)`` builds a
    fresh view on every call, which costs more than a small tensor's update.
    """
    if not is_dtensor(t):
        return t
    shard = getattr(t, "_local_tensor", None)
    return shard if shard is not None else t.to_local()


def _shard_key(t: torch.Tensor):
    """(mesh, mesh dims the tensor is sharded over), or None when nothing to sum."""
    if not is_dtensor(t):
        return None
    # Not `is_shard()`: FSDP2 over tensor parallelism places `_StridedShard`, which says False.
    dims = tuple(i for i, p in enumerate(t.placements)
                 if not (p.is_replicate() or p.is_partial()))
    return (t.device_mesh, dims) if dims else None


def by_device_and_dtype(params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``params`` bucketed by their local tensor's (device, dtype), in order."""
    buckets: dict = {}
    for i, p in enumerate(params):
        t = local(p)
        buckets.setdefault((t.device, t.dtype), []).append(i)
    return list(buckets.values())


def _local_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norm of each (local) tensor as 0-d tensors: one multi-tensor reduction per kind."""
    buckets = by_device_and_dtype(tensors)
    if len(buckets) == 1:
        return list(torch._foreach_norm(tensors))
    out: list = [None] * len(tensors)
    for idx in buckets:
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx]), strict=True):
            out[i] = n
    return out


def whole_norms(tensors: list[torch.Tensor], owners: list[torch.Tensor] | None = None
                ) -> list[torch.Tensor]:
    """L2 norm of each full tensor (DTensors reduced over their shards), as 0-d tensors.

    ``owners[i]`` is the parameter whose placements ``tensors[i]`` shares, for
    local tensors laid out like a sharded parameter (LAMB's update, gradients
    already unwrapped); by default each tensor is its own owner.

    For plain tensors these are exactly ``torch._foreach_norm``'s. No index
    tensors are built (that would copy from the host): groups are gathered with
    ``torch.stack`` and split with ``unbind``.
    """
    norms = _local_norms([local(t) for t in tensors])
    for (mesh, dims), idx in _shard_groups(tensors if owners is None else owners).items():
        squares = torch.stack([norms[i] for i in idx]).square()
        _sum_over(squares, mesh, dims)
        for i, n in zip(idx, squares.sqrt().unbind(), strict=True):
            norms[i] = n
    return norms


def sum_over_shards(squares: torch.Tensor, owners: list[torch.Tensor]) -> torch.Tensor:
    """Local sums of squares (a 1-d tensor, ``squares[i]`` of a tensor laid out
    like ``owners[i]``) summed over the mesh dimensions each owner is sharded on:
    the whole tensors' squared norms. One all-reduce per distinct (mesh, dims)."""
    for (mesh, dims), idx in _shard_groups(owners).items():
        if len(idx) == len(owners):  # all of them: reduce in place
            _sum_over(squares, mesh, dims)
            continue
        part = squares[idx]
        _sum_over(part, mesh, dims)
        squares[idx] = part
    return squares


def _shard_groups(owners: list[torch.Tensor]) -> dict:
    """Indices of ``owners`` by (mesh, sharded mesh dims); plain tensors left out."""
    groups: dict = {}
    for i, t in enumerate(owners):
        key = _shard_key(t)
        if key is not None:
            groups.setdefault(key, []).append(i)
    return groups


def _sum_over(values: torch.Tensor, mesh, dims: tuple[int, ...]) -> None:
    for dim in dims:
        # Looked up at call time, so a test can count the calls.
        torch.distributed.all_reduce(values, group=mesh.get_group(dim))


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all tensors together (each taken whole), as a 0-d tensor."""
    return torch.linalg.vector_norm(stack(whole_norms(tensors)))


def stack(scalars: list[torch.Tensor]) -> torch.Tensor:
    """0-d tensors into one 1-d tensor, on the first one's device and dtype."""
    first = scalars[0]
    return torch.stack([s.to(device=first.device, dtype=first.dtype) for s in scalars])
