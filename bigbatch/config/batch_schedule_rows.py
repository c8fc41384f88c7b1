"""The compatibility table's rows for a growing batch, ``batch.schedule`` = "adaptive",
"seesaw" or "auto" (`bigbatch.config.compat` splices them into `CONFLICTS`): where the
batch cannot change during a run, or something else already decides it."""

from __future__ import annotations

from typing import Any

from bigbatch.config.conflict import Conflict
from bigbatch.config.schedules import growth_of

__all__ = ["BATCH_SCHEDULE_ROWS", "batch_changer", "growing"]


def growing(s: Any) -> str | None:
    """``batch.schedule="..."`` as a user writes it when the batch grows; else None."""
    return None if growth_of(s) == "fixed" else f'batch.schedule="{s.batch.schedule}"'


def batch_changer(s: Any) -> str | None:
    """The `[adaptive]` setting that changes the batch during a run, if any."""
    a = s.adaptive
    return ('adaptive.batch_size="goodput"' if a.batch_size == "goodput" else
            'adaptive.policies=["goodput"]' if "goodput" in a.policies else
            'adaptive.policies=["noise_scale_doubling"]'
            if "noise_scale_doubling" in a.policies else None)


def _other_chooser(s: Any) -> str | None:
    """What else decides the batch, or (AdaScale) the LR it trains with."""
    return batch_changer(s) or ('adaptive.lr="adascale"' if s.adaptive.lr == "adascale"
                                else None)


_GROW = {"batch": {"schedule": "seesaw", "global_batch_size": 1024}}
_ADAPT = {"batch": {"schedule": "adaptive", "global_batch_size": 1024}}

C = Conflict
BATCH_SCHEDULE_ROWS: tuple[Conflict, ...] = (
    C("schedule-pipeline", "batch.schedule (a growing batch)", "[pipeline]",
      lambda s, c: growing(s) is not None and s.pipeline.enable,
      "{key} with {b}: {reason}; {fix}",
      "the pipeline's schedules are built for pipeline.accumulate_steps micro-batches of one "
      "shape, so the batch cannot change during a run",
      'use batch.schedule = "fixed", or train without [pipeline]',
      {**_GROW, "pipeline": {}}, values=lambda s, c: {"key": growing(s)}),
    C("schedule-parameter-server", "batch.schedule (a growing batch)", "[parameter_server]",
      lambda s, c: growing(s) is not None and s.parameter_server.enable,
      "{key} with {b}: {reason}; {fix}",
      "the parameter-server job's workers push fixed batches", 'use batch.schedule = "fixed"',
      {**_GROW, "parameter_server": {}}, values=lambda s, c: {"key": growing(s)}),
    C("schedule-batch-chooser", "batch.schedule (a growing batch)",
      "[adaptive] goodput, noise_scale_doubling or AdaScale",
      lambda s, c: growing(s) is not None and _other_chooser(s) is not None,
      "{key} with {other}: {reason}; {fix}",
      "both decide the batch or the LR it trains with", "keep one of them",
      {**_GROW, "adaptive": {"batch_size": "goodput"}},
      values=lambda s, c: {"key": growing(s), "other": _other_chooser(s)}),
    C("schedule-adaptive-mesh", 'batch.schedule = "adaptive"',
      "[sharding] or tensor parallelism",
      lambda s, c: (growth_of(s) == "adaptive"
                    and (s.sharding.enable or s.tensor_parallel.tensor_parallel_degree > 1)),
      "{key} with {what}: {reason}; {fix}",
      "it follows the noise scale, which needs each worker's whole gradient before it is "
      "reduced, and sharded or sliced gradients are not whole",
      'use batch.schedule = "seesaw" (it needs no noise scale), or plain data parallelism',
      {**_ADAPT, "sharding": {}},
      values=lambda s, c: {"key": growing(s), "what": "[sharding]" if s.sharding.enable
                           else "tensor parallelism"}),
)
del C
