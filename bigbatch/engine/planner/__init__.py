"""Planning a run past one machine: `plan()` lays a strategy out for N ranks on the meta
device and torch's fake process group, and reports per-rank memory, traffic per step,
the pipeline bubble and the batch arithmetic (`bigbatch plan` on the command line).

    from bigbatch import plan
    p = plan(lambda: MyModel(), strategy, world=1024,
             example=lambda b: (torch.zeros(b, 2048, dtype=torch.long),) * 2)
    p.to_dict()["per_rank_bytes"]     # {"params": ..., "grads": ..., "optimizer": ..., ...}
    print(p.summary())

Layers: `counting` (bytes by collective and mesh dimension, shared with the tests' real
runs), `fake` (the fake world), `layout` (prepare's steps on meta), `probe` (one
micro-batch on meta), `traffic` (data-parallel and pipeline arithmetic), `planning`
(`plan`, and `plan_layout` with a task's hooks), `result` and `report` (what a plan says),
`suggest` (layouts that fit). It lives in the engine because it is `prepare()`'s
layout on a fake world, by the same functions; `bigbatch plan` (the CLI) adds the
built-in tasks (`bigbatch.cli.plan`).
"""

from bigbatch.engine.planner.planning import plan
from bigbatch.engine.planner.result import LayoutPlan, RankPlan

__all__ = ["LayoutPlan", "RankPlan", "plan"]
