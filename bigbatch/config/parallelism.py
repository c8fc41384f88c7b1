"""How a job's ranks divide between pipeline, data, sharding and tensor parallelism.

The world is ``pipeline x data x tensor`` ranks, tensor innermost (neighbouring
ranks share a layer's slices, as Megatron places them) and pipeline outermost;
the data-parallel ranks split further into ``replicas x sharding_degree`` (HSDP)
when `[sharding]` names a degree. The batch formula's "world" is the data degree:
``global = micro x k_steps x data``, where a pipeline's micro-batches are the k_steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bigbatch.config.comm import check_pairwise_world
from bigbatch.errors import ConfigError

__all__ = ["Degrees", "check_pipeline_plan", "degrees"]


@dataclass(frozen=True)
class Degrees:
    """Ranks per mesh dimension; ``replicate x shard x tensor == world``."""

    replicate: int = 1
    """Data-parallel replicas of the (sharded) model state."""
    shard: int = 1
    """Data-parallel ranks that share one replica's state (1 without [sharding])."""
    tensor: int = 1
    """Tensor-parallel degree."""
    stage: int = 0
    """ZeRO stage, 0 without [sharding]."""
    pipeline: int = 1
    """Pipeline stages (ranks along the pipeline)."""
    servers: int = 0
    """Parameter-server ranks (the first ones); the data-parallel ranks follow them."""

    @property
    def data(self) -> int:
        """The data-parallel degree: ranks that see different samples."""
        return self.replicate * self.shard

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank` (tensor innermost, pipeline outermost)."""
        return (rank - self.servers) // self.tensor % self.data

    @property
    def world(self) -> int:
        return self.pipeline * self.data * self.tensor + self.servers

    # -- one fact each (torchtitan's ParallelDims) ----------------------------------------

    @property
    def dp_enabled(self) -> bool:
        """More than one data-parallel rank: the ranks see different samples and their
        gradients are reduced."""
        return self.data > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """More than one replica of the model state (DDP's ranks, HSDP's replicate dim)."""
        return self.replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """The model state is sharded over more than one data-parallel rank ([sharding])."""
        return self.shard > 1

    @property
    def tp_enabled(self) -> bool:
        """Tensor parallelism: layers sliced over more than one rank (DTensor plans)."""
        return self.tensor > 1

    @property
    def pp_enabled(self) -> bool:
        """Pipeline parallelism: the model split into stages on more than one rank."""
        return self.pipeline > 1

    @property
    def zero1_enabled(self) -> bool:
        """ZeRO stage 1: only the optimizer state is sharded (ZeroRedundancyOptimizer over
        DDP, no mesh)."""
        return self.stage == 1

    @property
    def params_sharded(self) -> bool:
        """ZeRO stage 2 or 3: FSDP2 holds gradients and parameters as shards."""
        return self.stage >= 2

    @property
    def needs_mesh(self) -> bool:
        """The ranks are laid out on a `DeviceMesh` (``pp x dp_replicate x dp_shard x tp``):
        tensor or pipeline parallelism, or ZeRO stage 2-3. Without it, data parallelism is
        DDP (ZeRO-1 included) over the default process group."""
        return self.tp_enabled or self.pp_enabled or self.params_sharded

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 (`fully_shard`) wraps the model over the data-parallel ranks: any mesh run
        with more than one of them; it shards at ZeRO-2/3 and only all-reduces otherwise.
        (A pipeline that tracks the noise scale without [sharding] makes its stages DDP
        modules instead: `prepare()` decides that first.)"""
        return self.needs_mesh and self.dp_enabled

    @property
    def sharded_state(self) -> bool:
        """Each rank holds only part of the model's parameters, gradients and optimizer
        state (sliced by tensor parallelism, split into pipeline stages or sharded by
        FSDP2): checkpoints save it per rank through DCP, and one rank's overflow must
        stop every rank's step."""
        return self.tp_enabled or self.pp_enabled or self.params_sharded

    def describe(self) -> str:
        """One line for the overview table, e.g. ``data 4 x tensor 2, ZeRO-3 over 2 of 4``."""
        text = f"data {self.data}" + (f" x tensor {self.tensor}" if self.tp_enabled else "")
        if self.pp_enabled:
            text = f"pipeline {self.pipeline} x " + text
        if self.stage:
            text += f", ZeRO-{self.stage}"
            if self.dp_replicate_enabled:
                text += f" over {self.shard} of {self.data}"
        if self.servers:
            text += f" + {self.servers} parameter server{'s' if self.servers > 1 else ''}"
        return text


def degrees(strategy: Any, world_size: int) -> Degrees:
    """The mesh degrees of `strategy` on `world_size` ranks; a ConfigError if they don't fit."""
    ps = strategy.parameter_server
    if ps.enable:  # the other settings' checks refuse meshes with a parameter server
        if world_size <= ps.servers:
            raise ConfigError(
                f"parameter_server.servers={ps.servers} leaves no worker among {world_size} "
                f"ranks; start more ranks (--nproc >= {ps.servers + 1})")
        return Degrees(replicate=world_size - ps.servers, servers=ps.servers)
    tp = strategy.tensor_parallel.tensor_parallel_degree
    pp = strategy.pipeline.pp_degree if strategy.pipeline.enable else 1
    if world_size % (tp * pp):
        raise ConfigError(
            f"pipeline.pp_degree={pp} x tensor_parallel.tensor_parallel_degree={tp} = {pp * tp} "
            f"does not divide the world size {world_size}; use degrees whose product divides it")
    data = world_size // (tp * pp)
    check_pairwise_world(strategy, world_size)  # local SGD runs on plain DDP: data = world
    if strategy.pipeline.enable and strategy.pipeline.schedule_mode == "PipeDream" and data > 1:
        raise ConfigError(
            f"pipeline.schedule_mode = \"PipeDream\" runs on the pipeline ranks alone; the world "
            f"size {world_size} leaves a data-parallel degree of {data} (use pp_degree = world size)")
    sharding = strategy.sharding
    if not sharding.enable:
        return Degrees(replicate=data, shard=1, tensor=tp, stage=0, pipeline=pp)
    shard = sharding.sharding_degree or data
    if data % shard:
        raise ConfigError(
            f"sharding.sharding_degree={shard} does not divide the data-parallel degree {data} "
            f"(world size {world_size} / (pipeline x tensor) {pp * tp}); use a divisor of {data}")
    return Degrees(replicate=data // shard, shard=shard, tensor=tp, stage=sharding.stage,
                   pipeline=pp)


def check_pipeline_plan(strategy: Any, k_steps: int) -> None:
    """The pipeline needs at least one micro-batch per stage in each optimizer step."""
    pipe = strategy.pipeline
    if pipe.enable and k_steps < pipe.pp_degree:
        raise ConfigError(
            f"pipeline.accumulate_steps={k_steps} micro-batches per step is fewer than the "
            f"{pipe.pp_degree} stages (pp_degree): some stages would never work; use >= "
            f"{pipe.pp_degree}")
