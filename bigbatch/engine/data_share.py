"""Each rank's share of the data, by the mesh's data rank and degree, and the check that
tensor-parallel ranks were given the same inputs.

Under tensor (or pipeline) parallelism several ranks hold parts of one model replica and
must read the *same* micro-batch: the share is set by the data-parallel rank
(`ParallelMesh.data_rank`) among `data_degree` ranks, not the global rank among the
world. A `DistributedSampler(data, world_size, rank)` there gives each tensor-parallel
rank different data and trains wrong without an error; `run.sampler(data)` and
`run.loader(data)` (like Accelerate's ``prepare(dataloader)``) give the right share, and
the first micro-step of a tensor-parallel run compares its loss over the tensor-parallel
ranks (one two-float all-reduce, once) and stops in one line when they differ.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bigbatch.errors import on_every_rank
from bigbatch.optim._norms import local

__all__ = ["InputMismatchError", "data_loader", "data_sampler", "check_same_inputs"]

# Relative gap between tensor-parallel ranks' losses taken as different inputs; the same
# inputs give the same loss to the bit (the reductions are all-reduces).
_TOLERANCE = 1e-6


class InputMismatchError(RuntimeError):
    """Tensor-parallel ranks of one replica were given different inputs."""


def data_sampler(mesh: Any, dataset: Any, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> torch.utils.data.DistributedSampler:
    """A `DistributedSampler` over `dataset` for this rank's data-parallel place: every
    tensor-parallel (and pipeline) rank of one replica reads the same samples. Call its
    ``set_epoch(epoch)`` each epoch for a new shuffle, the same on every rank."""
    return torch.utils.data.DistributedSampler(
        dataset, num_replicas=mesh.data_degree, rank=mesh.data_rank, shuffle=shuffle,
        seed=seed, drop_last=drop_last)


def data_loader(mesh: Any, dataset: Any, batch_size: int, *, shuffle: bool = True,
                seed: int = 0, **kwargs: Any) -> torch.utils.data.DataLoader:
    """A `DataLoader` of micro-batches of `batch_size` over this rank's share
    (`data_sampler`); ``loader.sampler.set_epoch(epoch)`` reshuffles. `kwargs` go to the
    `DataLoader` (``num_workers``, ``collate_fn``, ...); ``drop_last`` defaults to True,
    so every micro-batch is whole and every rank takes the same number of steps."""
    drop_last = kwargs.pop("drop_last", True)
    sampler = data_sampler(mesh, dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                       drop_last=drop_last, **kwargs)


def check_same_inputs(loss: torch.Tensor, group: Any, tensor_rank: int) -> None:
    """Raise `InputMismatchError` when the tensor-parallel ranks of `group` computed
    different losses at this micro-step (they were given different inputs)."""
    value = local(loss.detach()).reshape(-1)[:1].to(torch.float64).sum()
    both = torch.stack([value, -value])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = float(both[0]), -float(both[1])
    if abs(high - low) > _TOLERANCE * max(1.0, abs(high)):
        raise on_every_rank(InputMismatchError(
            f"tensor-parallel ranks got different inputs at the first step (losses "
            f"{low:.6g} to {high:.6g} across the tensor group of rank {tensor_rank}): give "
            "each rank its share by the data rank, run.loader(data) or run.sampler(data) "
            "(DistributedSampler(data, run.mesh.data_degree, run.mesh.data_rank)), not the "
            "global rank"))
