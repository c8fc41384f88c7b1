"""What a run will do before it starts: its task (built once, rank 0 first) and its
batch plan, sampler and step counts (`plan_run`); shared by the main job, the
parameter-server job, the launcher's preflight and the study."""

from __future__ import annotations

from typing import Any

from bigbatch.config.elastic import resume_plan
from bigbatch.config.parallelism import check_pipeline_plan, degrees
from bigbatch.config.strategy import Strategy
from bigbatch.engine.run import schedule_steps
from bigbatch.parallel.world import World, barrier
from bigbatch.tasks import Task, get_task
from bigbatch.tasks.sampler import GlobalBatchSampler
from bigbatch.train.config import TrainConfig

__all__ = ["build_model", "fit_warmup", "load_task", "plan_run"]


def load_task(config: TrainConfig, world: World) -> Task:
    """The task, built on rank 0 first so a data-set cache is generated only once."""
    if world.rank == 0:
        task = get_task(config.task, **config.task_options)
    barrier(world)
    if world.rank != 0:
        task = get_task(config.task, **config.task_options)
    return task


def fit_warmup(config: TrainConfig, strategy: Strategy, task: Task,
               world_size: int) -> tuple[Strategy, str | None]:
    """(the strategy to run, a one-line note or None): with `config.fit_warmup` (the warmup
    is the task demo's, not the user's), a run shorter than the recipe's gets the warmup
    scaled to it (`bigbatch.config.schedules.scaled_warmup`), written as `batch.warmup_steps`
    so that `strategy.toml` and a resume keep it. Otherwise the strategy unchanged."""
    from bigbatch.config.schedules import scaled_warmup, warmup_steps_of

    b = strategy.batch
    if not config.fit_warmup or config.resume or not (b.warmup_steps or b.warmup_epochs):
        return strategy, None
    data = degrees(strategy, world_size).data
    n = len(task.train_set)
    recipe_epochs = task.recipe(config.model).epochs
    recipe_steps, spe = schedule_steps(strategy, data, n, recipe_epochs)
    steps = config.steps if config.steps is not None else schedule_steps(
        strategy, data, n, config.epochs if config.epochs is not None else recipe_epochs)[0]
    warmup = warmup_steps_of(b.warmup_steps, b.warmup_epochs, spe)
    fitted = scaled_warmup(warmup, steps, recipe_steps)
    if fitted == warmup:
        return strategy, None
    note = (f"warmup scaled to the run: {fitted} of {steps} steps (the task's default is "
            f"{warmup} of its recipe's {recipe_steps}; set batch.warmup_steps to choose)")
    return strategy.with_overrides(["batch.warmup_epochs=0.0",
                                    f"batch.warmup_steps={fitted}"]), note


def build_model(task: Task, name: str, seed: int, strategy: Strategy) -> Any:
    """The task's model with its initial weights drawn from
    `tensor_parallel.tensor_init_seed`, else from the run's `seed`, whole on every rank
    (the layout slices it later): the same weights whatever the degrees. The global RNGs
    are left seeded with `seed` either way."""
    from bigbatch.train import data

    init_seed = strategy.tensor_parallel.tensor_init_seed
    data.seed_everything(seed if init_seed is None else init_seed)
    model = task.build_model(name)
    if init_seed is not None:
        data.seed_everything(seed)
    return model


def plan_run(config: TrainConfig, strategy: Strategy, task: Task, world_size: int,
             rank: int = 0, saved: dict | None = None) -> tuple[Any, GlobalBatchSampler, int, int]:
    """(BatchPlan, this worker's sampler, total_steps, steps_per_epoch) in the schedule's units.

    `saved`: a checkpoint's batch state (`Run.state_dict()["batch"]`): the plan
    follows `bigbatch.config.elastic.resume_plan` and the units stay the checkpoint's.
    Validates the schedule too, so a launcher can report every config mistake
    before starting workers.
    """
    from bigbatch.config.schedules import Schedule

    deg = degrees(strategy, world_size)
    if deg.tensor > 1:
        task.check_tensor_parallel(deg.tensor)
    if saved is not None:
        plan, unit = resume_plan(strategy, deg.data, saved), saved["unit_batch_size"]
    else:
        plan, unit = strategy.resolve(deg.data), None
    check_pipeline_plan(strategy, plan.k_steps)
    n = len(task.train_set)
    # Tensor-parallel peers share their samples: the sampler counts data-parallel ranks.
    sampler = GlobalBatchSampler(n, plan.global_batch_size, plan.micro_batch_size, deg.data,
                                 deg.data_rank(rank), config.seed)
    epochs = config.epochs if config.epochs is not None else task.recipe(config.model).epochs
    total_steps, spe = schedule_steps(strategy, deg.data, n, epochs, unit)
    if config.steps is not None:
        total_steps = config.steps
    Schedule.from_strategy(strategy, plan, total_steps, spe)
    return plan, sampler, total_steps, spe
