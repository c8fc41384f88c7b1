"""`parallelize`: the one function that lays a model out on the mesh, in order.

    tensor parallel -> recompute -> FSDP2

as torchtitan's per-model ``parallelize`` does. `prepare` splits a `[pipeline]` model
into its stage first and calls this on the stage (or on the whole model). What it reads
of the model is its `ModelPlan`: the tensor-parallel plan and the block classes; a
model whose layout needs more passes its own function as ``ModelPlan(parallelize=...)``,
with this signature, and `prepare` calls that instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigbatch.engine.recompute import apply_recompute
from bigbatch.parallel.mesh import ParallelMesh

__all__ = ["parallelize"]


def parallelize(module: nn.Module, mesh: ParallelMesh, strategy: Any, plan: Any, *,
                stage_of: Any = None, param_dtype: torch.dtype | None = None,
                fsdp: bool = True) -> bool:
    """Lay `module` out on `mesh` as `strategy` says; True when its output is a DTensor
    sharded on the vocabulary (the loss then runs under ``loss_parallel``).

    1. Tensor parallel (`[tensor_parallel]`): `plan.tp_plan`, whose every parameter ends a
       DTensor (the rest replicated); under a pipeline (`stage_of`, the `PipelineRunner`)
       only the entries of this stage's modules.
    2. Recompute (`[recompute] checkpoints` present in `module`): forwards wrapped in
       place, names unchanged.
    3. FSDP2 (ZeRO-2/3, or a mesh's data dimension; `fsdp`): every `nn.ModuleList`
       block and each module of a `plan.blocks` class a unit, then the root; at stage 2-3
       with `data_parallel.find_unused_parameters` each reduces zeros for the parameters
       a rank did not use (`bigbatch.parallel.sharding.reduce_unused`).
    """
    degrees = mesh.degrees
    loss_parallel = False
    if degrees.tp_enabled:
        from bigbatch.parallel.tensor_parallel import (
            apply_tensor_parallel,
            present_plan,
            uses_loss_parallel,
        )

        # Every parameter a DTensor: norms, clipping and the loss scaler then see one kind.
        tp_plan = present_plan(module, plan.tp_plan) if stage_of is not None else plan.tp_plan
        apply_tensor_parallel(module, mesh.tp_mesh, tp_plan, replicate_rest=True)
        loss_parallel = uses_loss_parallel(module)
    if strategy.recompute.enable:
        present = set(dict(module.named_modules()))
        apply_recompute(module, [n for n in strategy.recompute.checkpoints if n in present])
    if fsdp and degrees.fsdp_enabled:
        from bigbatch.parallel.sharding import apply_fsdp, reduce_unused

        one_root = stage_of is None or len(stage_of.stage_ids) == 1
        apply_fsdp(module, mesh, stage=degrees.stage, offload=strategy.sharding.offload,
                   param_dtype=param_dtype,
                   units=stage_of.fsdp_units() if stage_of is not None else None,
                   root=one_root, unit_classes=tuple(plan.blocks),
                   unused=reduce_unused(strategy, degrees.stage))
    return loss_parallel
