"""A world of N ranks in this one process: torch's fake process group, as one rank of it.

Collectives on it return at once and move nothing, so the mesh, the tensor-parallel plan,
FSDP2's sharding and the pipeline's groups are built exactly as on N real ranks, from the
same code, on a machine that has one CPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[World]:
    """Be rank `rank` of `world_size` (a fake default process group) inside; a world of one
    needs no group. Refused inside a job that already has a process group."""
    if dist.is_initialized():
        raise ConfigError("bigbatch plan lays out a world of its own: call it outside a job "
                          "that has a process group")
    world = World(rank=rank, world_size=world_size, device=torch.device("cpu"))
    if world_size == 1:
        yield world
        return
    # torch's fake backend and store ("fake"; the module registers the backend on import).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield world
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Drop DTensor's cached sharding decisions: they hold the meshes they were made on,
    and a mesh of the next simulated rank compares equal to one of this rank (equality
    leaves the rank out), so a cached answer would point at this world's dead groups."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, propagator._propagate_tensor_meta_cached):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path keeps its own
        native()
