"""Small helpers of `bigbatch.train.trainer`: seeding, collectives on Python objects, the output
directory, batches, the non-finite loss guard."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch

from bigbatch.parallel.world import World


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
