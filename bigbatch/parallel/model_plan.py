"""`ModelPlan`: what a model contributes to parallelism, in one place.

    plan = ModelPlan(blocks=("LlamaDecoderLayer",),
                     tp_plan={"model.layers.*.self_attn.q_proj": "colwise", ...},
                     pipeline_layers=None)
    run = bigbatch.prepare(model, strategy, total_steps, model_plan=plan)

- `blocks`: the classes of the model's repeated blocks. They are the FSDP2 units of
  ZeRO-2/3 besides the entries of every `nn.ModuleList`, which are found without a plan
  (`bigbatch.parallel.sharding.shard_units`).
- `tp_plan`: the tensor-parallel plan (`bigbatch.parallel.tensor_parallel`): every entry
  must name at least one module of the model, or the run is refused naming the entry.
- `pipeline_layers`: the model's chain of `bigbatch.parallel.pipeline.Layer`s (default:
  `model.pipeline_layers()`; `bigbatch.parallel.pipeline.decoder_layers` builds it for
  an HF-shaped decoder).
- `parallelize`: a function that replaces `bigbatch.engine.parallelize.parallelize`
  (tensor parallel -> recompute -> FSDP2) for this model.

Built-in tasks pass theirs; `prepare`'s own `tp_plan=` / `pipeline_layers=` arguments
take precedence over the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ModelPlan"]


@dataclass(frozen=True)
class ModelPlan:
    """A model's repeated blocks, tensor-parallel plan and pipeline layers."""

    blocks: tuple[str | type[nn.Module], ...] = ()
    """Block classes (or their names) sharded one by one under ZeRO-2/3."""
    tp_plan: Any = None
    """{module name pattern: style} or a ``parallelize(model, mesh)`` callable."""
    pipeline_layers: Any = None
    """The chain of `Layer`s a `[pipeline]` run splits into stages."""
    parallelize: Any = None
    """Your own ``parallelize(module, mesh, strategy, plan, *, stage_of, param_dtype, fsdp)
    -> loss_parallel`` in place of `bigbatch.engine.parallelize.parallelize` (the same
    arguments; it lays out one stage, or the whole model)."""

    def __post_init__(self) -> None:
        if isinstance(self.blocks, str | type):
            object.__setattr__(self, "blocks", (self.blocks,))
