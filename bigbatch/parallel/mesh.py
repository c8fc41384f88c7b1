"""The run's device mesh: torch's `DeviceMesh` over ``pp x dp_replicate x dp_shard x tp``.

Built from the degrees in `bigbatch.config.parallelism` and the torchrun world.
Tensor-parallel ranks are innermost (neighbours, as Megatron places them) and
pipeline stages outermost. Plain data parallelism (DDP, ZeRO stage 1) needs no
mesh: the default process group is its group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from bigbatch.config.parallelism import Degrees
from bigbatch.parallel.world import World

__all__ = ["ParallelMesh"]

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class ParallelMesh:
    """Where this rank sits in data, sharding and tensor parallelism, and their groups."""

    def __init__(self, degrees: Degrees, world: World) -> None:
        if degrees.world != world.world_size:
            raise ValueError(f"mesh {degrees} does not cover the world of {world.world_size}")
        self.degrees = degrees
        self.world = world
        self.device_mesh: Any = None
        """The `DeviceMesh` (dims `pp`, `dp_replicate`, `dp_shard`, `tp`), None when not needed."""
        self._dp: Any = None
        if degrees.needs_mesh and world.is_distributed:
            from torch.distributed.device_mesh import init_device_mesh

            self.device_mesh = init_device_mesh(
                world.device.type,
                (degrees.pipeline, degrees.replicate, degrees.shard, degrees.tensor),
                mesh_dim_names=DIMS)
            self._dp = self.device_mesh["dp_replicate", "dp_shard"]._flatten("dp")

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel ranks (what its sampler reads)."""
        return self.degrees.data_rank(self.world.rank)

    @property
    def tensor_rank(self) -> int:
        return self.world.rank % self.degrees.tensor

    @property
    def pipeline_rank(self) -> int:
        """This rank's pipeline stage (the first of its stages when interleaved)."""
        return self.world.rank // (self.degrees.data * self.degrees.tensor)

    @property
    def pp_group(self) -> Any:
        """The process group along this rank's pipeline (None without one)."""
        return self.device_mesh["pp"].get_group() if self.degrees.pp_enabled else None

    def rank_at(self, pipeline_rank: int) -> int:
        """The global rank of the stage `pipeline_rank` with this rank's data and tensor place."""
        d = self.degrees
        return (pipeline_rank * d.data + self.data_rank) * d.tensor + self.tensor_rank

    @property
    def data_degree(self) -> int:
        return self.degrees.data

    @property
    def dp_group(self) -> Any:
        """The process group over the data-parallel ranks (the default group without TP)."""
        return self._dp.get_group() if self._dp is not None else dist.group.WORLD

    @property
    def tp_mesh(self) -> Any:
        """The 1-D tensor-parallel mesh (None at degree 1)."""
        return self.device_mesh["tp"] if self.degrees.tp_enabled else None

    @property
    def fsdp_mesh(self) -> Any:
        """The mesh FSDP2 shards over: 1-D ``dp_shard``, or 2-D (replicate, shard) for HSDP."""
        if not self.degrees.dp_replicate_enabled:
            return self.device_mesh["dp_shard"]
        return self.device_mesh["dp_replicate", "dp_shard"]
