"""ZeRO sharding on torch's own engine (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models").

- Stage 1, optimizer state: `ZeroRedundancyOptimizer` over DDP. Each rank keeps
  the state of whole parameters (a partition of them) and steps only those, so a
  LARS/LAMB trust ratio sees whole tensors; the updated parameters are broadcast.
- Stage 2, + gradients: FSDP2 `fully_shard` that keeps the gathered parameters
  from forward to backward (`reshard_after_forward=False`); gradients are
  reduce-scattered, each rank keeps its shard.
- Stage 3, + parameters: FSDP2 `fully_shard` per block, then the root, gathering
  each block's parameters only while it runs.

FSDP2 turns every parameter into a DTensor sharded on dim 0 over the sharding
mesh; `bigbatch.optim` takes whole-tensor norms of DTensors in one collective
per step, so the optimizers behave exactly as on one worker.

With `data_parallel.find_unused_parameters` (stages 2-3) FSDP2 reduce-scatters a zero
gradient for each parameter of a module that ran but that a rank's backward did not
reach (`FSDPModule.set_reduce_scatter_unused_params`, torch 2.13 or newer), as DDP's
pass does, so ranks that take different branches reduce the same tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from bigbatch.parallel.mesh import ParallelMesh

__all__ = ["apply_fsdp", "fsdp_reduces_unused", "reduce_unused", "shard_units",
           "zero_optimizer"]

log = logging.getLogger("bigbatch.sharding")


def fsdp_reduces_unused() -> bool:
    """This torch's FSDP2 can reduce zero gradients for the parameters a rank did not use
    (`FSDPModule.set_reduce_scatter_unused_params`, torch 2.13 or newer; not in 2.11)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def reduce_unused(strategy: Any, stage: int) -> bool:
    """FSDP2 at ZeRO stage `stage` reduces zeros for unused parameters under `strategy`:
    `data_parallel.find_unused_parameters` at stage 2-3 (the compatibility table refuses
    it there on a torch without `fsdp_reduces_unused`)."""
    return bool(strategy.data_parallel.find_unused_parameters) and stage >= 2


def shard_units(model: nn.Module, classes: tuple[str | type, ...] = ()) -> list[nn.Module]:
    """The modules FSDP2 shards one by one before the root, outermost first:

    - the entries of every `nn.ModuleList` anywhere in the model (a Transformer's blocks:
      HF's ``model.layers``, ``transformer.h``, ``encoder.layer``), and of the model's
      top-level `nn.Sequential` containers;
    - every module of a class in `classes` (a class or its name), for models that keep
      their blocks otherwise.

    Only modules that hold parameters count, and none inside another unit: what is left
    (embeddings, heads, norms) goes with the root.
    """
    names = {c if isinstance(c, str) else c.__name__ for c in classes}
    picked: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p, _ in picked):
            continue  # inside a unit already taken
        top = "." not in name and name != ""
        if type(module).__name__ in names and name:
            picked.append((name, module))
            continue
        if isinstance(module, nn.ModuleList) or (top and isinstance(module, nn.Sequential)):
            picked += [(f"{name}.{i}", m) for i, m in enumerate(module)
                       if next(m.parameters(), None) is not None]
    return [m for _, m in picked]


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, *, stage: int, offload: bool = False,
               param_dtype: torch.dtype | None = None,
               units: list[nn.Module] | None = None, root: bool = True,
               unit_classes: tuple[str | type, ...] = (),
               unused: bool = False) -> nn.Module:
    """`fully_shard` each unit, then the root, over the mesh's data-parallel dimensions.

    `stage` 3 frees gathered parameters after each unit's forward; 2 keeps them until
    backward; 0 (tensor parallel with a replicated data dimension: a sharding degree of
    1) makes FSDP2 a plain all-reduce. `param_dtype`: compute dtype of FSDP2's
    mixed-precision policy (gradients are reduced in float32). `root=False` leaves the
    root alone: a module whose own forward never runs (interleaved pipeline chunks call
    its parts), so its units are roots of their own. `unit_classes`: block classes
    sharded as units besides the `nn.ModuleList` entries (`shard_units`). `unused`: a
    parameter of a module that ran which this rank's backward did not reach gets a zero
    gradient reduced with its peers' (`reduce_unused`); needs `fsdp_reduces_unused()`.

    Stage 3 with no unit gathers every parameter at once in forward (ZeRO-2's memory):
    a one-line warning says so and how to name the blocks.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh.fsdp_mesh, "reshard_after_forward": stage == 3}
    if offload:
        # Pinned host memory needs an accelerator; on a CPU-only worker it is plain memory.
        kwargs["offload_policy"] = CPUOffloadPolicy(
            pin_memory=mesh.world.device.type == "cuda")
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                   reduce_dtype=torch.float32)
    chosen = shard_units(model, unit_classes) if units is None else units
    if stage == 3 and not chosen and root:
        log.warning("ZeRO-3: %s has no repeated blocks (no nn.ModuleList of blocks): only the "
                    "root is sharded, so forward gathers every parameter at once; name the "
                    "block class (model plan `blocks=`)", type(model).__name__)
    if unused and not fsdp_reduces_unused():
        raise RuntimeError(f"FSDP2 reduces zero gradients for unused parameters from torch "
                           f"2.13 on; this is torch {torch.__version__}")
    for unit in chosen:
        fully_shard(unit, **kwargs)
        if unused:
            unit.set_reduce_scatter_unused_params(True, recurse=False)
    if root:
        fully_shard(model, **kwargs)
        if unused:
            model.set_reduce_scatter_unused_params(True, recurse=False)
    return model


def zero_optimizer(groups: list[dict[str, Any]], optimizer_class: type,
                   **defaults: Any) -> torch.optim.Optimizer:
    """`ZeroRedundancyOptimizer` over `groups` (param-group dicts whose extra keys, such
    as LARS/LAMB's `weight_decay` and `layer_adaptation`, reach each rank's local
    optimizer with the parameters it owns)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # Names would not survive ZeRO's re-partitioning of the groups' parameter lists.
    groups = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, **defaults)
