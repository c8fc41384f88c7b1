"""One rank's part of a run, laid out on the meta device by the steps `prepare()` takes,
in its order: recompute, the device mesh, the pipeline split, the tensor-parallel plan
(`parallelize_module`), FSDP2's units (`fully_shard`), the optimizer (ZeRO-1's
`ZeroRedundancyOptimizer` included). The functions are the engine's own, so a layout that
`prepare()` refuses is refused here with the same message.

Between slicing and sharding, `probe` runs one micro-batch through the rank's stages
(`bigbatch.planner.probe`): activations do not depend on how FSDP stores the weights,
and FSDP's gathers could not run on weights that do not exist.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bigbatch.config.parallelism import Degrees
from bigbatch.engine.optimizer import build_optimizer, replica_group
from bigbatch.engine.recompute import apply_recompute
from bigbatch.parallel.mesh import ParallelMesh
from bigbatch.parallel.world import World
from bigbatch.planner.counting import dims_of
from bigbatch.planner.probe import Probe, StageRun
from bigbatch.planner.traffic import unit_params

__all__ = ["RankLayout", "chain_inputs", "lay_out"]


@dataclass
class RankLayout:
    """One rank's model, mesh, pipeline stages, FSDP units and optimizer (all on meta)."""

    module: nn.Module
    """This rank's model (its pipeline stage), sliced and sharded."""
    mesh: ParallelMesh
    pipeline: Any
    """The `PipelineRunner` (None without `[pipeline]`)."""
    names: dict[str, str]
    """Process group names -> mesh dimensions (`bigbatch.planner.counting.dims_of`)."""
    fsdp_groups: list[list[nn.Parameter]] = field(default_factory=list)
    """Parameters of each FSDP unit (empty without FSDP)."""
    optimizer: Any = None
    probe: Probe | None = None


@torch.no_grad()
def chain_inputs(model: nn.Module, layers: Sequence[Any], x: torch.Tensor) -> list[torch.Tensor]:
    """The input of each pipeline layer for one micro-batch `x` (meta: shapes only)."""
    inputs = []
    for layer in layers:
        inputs.append(x)
        x = layer.run(model, x)
    return inputs


def _run_layers(model: nn.Module, layers: Sequence[Any], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer.run(model, x)
    return x


def stage_runs(module: nn.Module, pipeline: Any, layers: Sequence[Any] | None,
               inputs: Sequence[torch.Tensor] | None, x: torch.Tensor) -> list[StageRun]:
    """This rank's stages as `StageRun`s: the whole model, or each pipeline stage it holds
    (by the pipeline's own split) from its first layer's input."""
    if pipeline is None:
        return [StageRun(module, x, True, True)]
    index = {layer.name: i for i, layer in enumerate(layers)}
    runs = []
    for stage, names in zip(pipeline.stage_ids, pipeline.layer_names, strict=True):
        mine = [layers[index[n]] for n in names]
        runs.append(StageRun(functools.partial(_run_layers, module, mine),
                             inputs[index[names[0]]], stage == 0,
                             stage == pipeline.num_stages - 1))
    return runs


def lay_out(model: nn.Module, strategy: Any, deg: Degrees, world: World, *, tp_plan: Any,
            pipeline_layers: Sequence[Any] | None,
            probe: Callable[[nn.Module, Any, dict[str, str], Sequence[Any] | None,
                             Sequence[torch.Tensor] | None], Probe | None] | None,
            example: torch.Tensor | None, cache: dict | None = None) -> RankLayout:
    """`model` (built on meta) laid out as rank `world.rank` of `deg`; `probe(module,
    pipeline, names, layers, inputs)` runs after slicing, before sharding. `cache` keeps
    the layers' inputs between layouts of the same model (they depend only on the
    micro-batch's shape, not on the degrees)."""
    checkpoints = list(strategy.recompute.checkpoints) if strategy.recompute.enable else []
    if checkpoints:
        apply_recompute(model, checkpoints)
    mesh = ParallelMesh(deg, world)
    pipeline = layers = inputs = None
    if deg.pp_enabled:
        from bigbatch.parallel.pipeline import model_layers
        from bigbatch.parallel.pipeline_schedule import PipelineRunner

        layers = list(pipeline_layers) if pipeline_layers is not None else model_layers(model)
        if example is not None and probe is not None:
            # before the split prunes them
            key = ("chain", tuple(layer.name for layer in layers), tuple(example.shape),
                   example.dtype)
            if cache is None or key not in cache:
                inputs = chain_inputs(model, layers, example)
                if cache is not None:
                    cache[key] = inputs
            inputs = cache[key] if cache is not None else inputs
        pipeline = PipelineRunner(model, layers, mesh, strategy.pipeline)
        model = pipeline.module
    if deg.tp_enabled:
        from bigbatch.parallel.tensor_parallel import apply_tensor_parallel, present_plan

        apply_tensor_parallel(model, mesh.tp_mesh, present_plan(model, tp_plan),
                              replicate_rest=True)
    names = dims_of(mesh)
    for _, group in getattr(pipeline, "tied", ()):
        names.setdefault(group.group_name, "pp")
    out = RankLayout(module=model, mesh=mesh, pipeline=pipeline, names=names)
    if probe is not None:
        out.probe = probe(model, pipeline, names, layers, inputs)
    if deg.fsdp_enabled:
        from bigbatch.parallel.sharding import apply_fsdp, shard_units

        amp = strategy.amp
        one_root = pipeline is None or len(pipeline.stage_ids) == 1
        units = pipeline.fsdp_units() if pipeline is not None else shard_units(model)
        apply_fsdp(model, mesh, stage=deg.stage, offload=strategy.sharding.offload,
                   param_dtype=torch.bfloat16 if amp.enable and amp.dtype == "bfloat16"
                   else None, units=units, root=one_root)
        out.fsdp_groups = unit_params(units, model if one_root else None)
    out.optimizer = build_optimizer(model, strategy, lr=1e-3, zero=deg.zero1_enabled,
                                    replicas=replica_group(strategy, mesh))
    return out
