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

from bigbatch.errors import ConfigError

__all__ = ["Degrees", "check_parallel_combination", "check_pipeline_plan", "degrees"]


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

    @property
    def uses_mesh(self) -> bool:
        """Whether the run needs the device mesh: FSDP2, tensor or pipeline parallelism
        (the model's state is then saved per rank, through DCP)."""
        return self.tensor > 1 or self.stage >= 2 or self.pipeline > 1

    def describe(self) -> str:
        """One line for the overview table, e.g. ``data 4 x tensor 2, ZeRO-3 over 2 of 4``."""
        text = f"data {self.data}" + (f" x tensor {self.tensor}" if self.tensor > 1 else "")
        if self.pipeline > 1:
            text = f"pipeline {self.pipeline} x " + text
        if self.stage:
            text += f", ZeRO-{self.stage}"
            if self.replicate > 1:
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


def check_parallel_combination(strategy: Any) -> None:
    """Settings that cannot go together whatever the world size."""
    sharded = strategy.sharding.enable
    tp = strategy.tensor_parallel.tensor_parallel_degree
    pipe = strategy.pipeline
    if pipe.enable:
        _check_pipeline(strategy)
    if not sharded and tp == 1 and not pipe.enable:
        return
    what = "[sharding]" if sharded else "tensor parallelism" if tp > 1 else "[pipeline]"
    reduce = "dgc" if strategy.dgc.enable else strategy.data_parallel.reduce
    if reduce != "mean":
        how = "Adasum combines" if reduce == "adasum" else "that reduce is a DDP comm hook over"
        raise ConfigError(
            f"data_parallel.reduce={reduce!r} with {what}: {how} whole per-worker gradients, "
            "which sharded or sliced gradients are not; use reduce = \"mean\"")
    if strategy.adaptive.active and sharded and pipe.enable:
        raise ConfigError(
            f"{_adaptive_key(strategy.adaptive)} with [pipeline] and [sharding]: each stage is "
            "then an FSDP2 module, which accumulates the micro-batches' gradients in its own "
            "copies, so micro-batch 0's gradient never reaches the parameters; switch "
            "[sharding] off (the stages' data parallelism is then DDP) or [adaptive] off")
    if strategy.adaptive.active and (sharded or tp > 1):
        raise ConfigError(
            f"[adaptive] with {what}: the noise scale, AdaScale and goodput need each worker's "
            "whole gradient before it is reduced, which sharded or sliced gradients are not; "
            "switch [adaptive] off or use plain data parallelism")
    if "straggler" in strategy.adaptive.policies:
        raise ConfigError(
            f'adaptive.policies = ["straggler"] with {what}: compute time is told apart from '
            "the wait for other workers in DDP's backward only, and rebalancing changes each "
            "worker's batch; use plain data parallelism")
    if sharded and strategy.sharding.stage == 1 and tp > 1:
        raise ConfigError(
            "sharding.stage=1 (ZeroRedundancyOptimizer over DDP) does not combine with "
            "tensor_parallel_degree > 1; use sharding.stage 2 or 3")
    if strategy.data_parallel.sync_batch_norm:
        raise ConfigError(
            f"data_parallel.sync_batch_norm with {what} is not supported; switch one off")


def _check_pipeline(strategy: Any) -> None:
    pipe, batch = strategy.pipeline, strategy.batch
    if strategy.gradient_merge.enable:
        raise ConfigError("[gradient_merge] with [pipeline]: the pipeline's micro-batches are the "
                          "merge; set pipeline.accumulate_steps instead of gradient_merge.k_steps")
    if (pipe.micro_batch_size and batch.micro_batch_size
            and pipe.micro_batch_size != batch.micro_batch_size):
        raise ConfigError(
            f"pipeline.micro_batch_size={pipe.micro_batch_size} and batch.micro_batch_size="
            f"{batch.micro_batch_size} disagree; set one of them")
    if strategy.max_grad_norm() is not None and pipe.schedule_mode == "PipeDream":
        raise ConfigError('max_grad_norm (clipping) with pipeline.schedule_mode = "PipeDream": '
                          "its stages update per micro-batch, with no step's whole gradient "
                          "to clip")
    if strategy.sharding.enable and strategy.sharding.stage == 1:
        raise ConfigError("sharding.stage=1 with [pipeline] is not supported; use stage 2 or 3")
    if strategy.adaptive.active:
        _check_pipeline_adaptive(strategy)
    if pipe.schedule_mode == "PipeDream" and (
            strategy.sharding.enable or strategy.tensor_parallel.tensor_parallel_degree > 1
            or strategy.amp.enable):
        raise ConfigError('pipeline.schedule_mode = "PipeDream" runs alone: without [sharding], '
                          "tensor parallelism or [amp]")


def _check_pipeline_adaptive(strategy: Any) -> None:
    """A pipeline tracks the noise scale (micro-batch 0 against the step) and takes AdaScale's
    gain; it cannot change its batch."""
    a = strategy.adaptive
    if strategy.pipeline.schedule_mode == "PipeDream":
        raise ConfigError(
            '[adaptive] with pipeline.schedule_mode = "PipeDream": its stages update after '
            "every micro-batch, so no step has a big-batch gradient to measure; use "
            '"GPipe", "1F1B" or "Interleaved1F1B"')
    key = ('adaptive.batch_size="goodput"' if a.batch_size == "goodput" else
           'adaptive.policies=["goodput"]' if "goodput" in a.policies else
           'adaptive.policies=["noise_scale_doubling"]'
           if "noise_scale_doubling" in a.policies else None)
    if key is not None:
        raise ConfigError(
            f"{key} with [pipeline]: the pipeline's schedules are built for "
            "pipeline.accumulate_steps micro-batches of one shape, so the batch cannot change "
            'during a run; keep adaptive.noise_scale or adaptive.lr="adascale"')


def _adaptive_key(a: Any) -> str:
    """The first `[adaptive]` setting that reads the noise scale, as a user writes it."""
    if a.noise_scale:
        return "adaptive.noise_scale=true"
    if a.lr != "none":
        return f'adaptive.lr="{a.lr}"'
    return 'adaptive.batch_size="goodput"' if a.goodput else "[adaptive]"
