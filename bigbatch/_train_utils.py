"""Small helpers of `bigbatch.train`: seeding, collectives on Python objects, batches."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bigbatch.distributed import World


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def barrier(world: World) -> None:
    if world.is_distributed and dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any, world: World) -> Any:
    """Rank 0's `obj` on every worker."""
    if not world.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any, world: World) -> list[Any]:
    """Every worker's `obj`, by rank, on every worker."""
    if not world.is_distributed:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def fetch(dataset, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The samples `idx` as a batch tuple on `device` (one gather per tensor for tensor data)."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is None:  # a generic Dataset: collate samples one by one
        from torch.utils.data import default_collate

        batch = default_collate([dataset[int(i)] for i in idx])
    else:
        batch = tuple(t[idx] for t in tensors)
    return tuple(t.to(device, non_blocking=True) for t in batch)


def shard_batches(dataset, world: World, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """This worker's contiguous shard of `dataset` in batches (evaluation)."""
    n = len(dataset)
    lo, hi = world.rank * n // world.world_size, (world.rank + 1) * n // world.world_size
    for start in range(lo, hi, batch_size):
        yield fetch(dataset, torch.arange(start, min(start + batch_size, hi)), torch.device("cpu"))


def sync_buffers(module: torch.nn.Module, world: World) -> None:
    """Give every worker rank 0's buffers (BatchNorm statistics).

    They drift apart between DDP's per-forward broadcasts; evaluating and saving
    rank 0's is what the next forward would do anyway.
    """
    if world.is_distributed:
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


def summed(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over all workers, in place (an evaluation `reduce`)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
