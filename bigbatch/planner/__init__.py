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
(`plan`, and `plan_task` for a built-in task), `result` and `report` (what a plan says),
`suggest` (layouts that fit). The package is not called `bigbatch.plan`: that name is
the function, as `bigbatch.prepare` is. It comes after `engine` and `tasks` (it lays
models out with their steps) and before `cli`.
"""

from bigbatch.planner.planning import plan
from bigbatch.planner.result import LayoutPlan, RankPlan

__all__ = ["LayoutPlan", "RankPlan", "plan"]
