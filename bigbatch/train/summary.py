"""`summary.json`: what a finished run reports, the same keys for every kind of job."""

from __future__ import annotations

from typing import Any

from bigbatch.train.progress import reference

__all__ = ["run_summary"]


def run_summary(*, task: Any, model: str, metrics: dict[str, float], steps: int, epochs: float,
                samples: int, plan: Any, world_size: int, strategy: Any, seed: int,
                wall_time_s: float, samples_per_s: float | None, peak_lr: float | None = None,
                budget_epochs: float | None = None, **extra: Any) -> dict[str, Any]:
    """The summary's common keys (the task, its test metrics, the batch plan, the run's
    length and speed, the small-batch reference of the same epochs), then `extra`, then
    the strategy. `peak_lr`: the peak the run trained with, where not the plan's
    (`batch.lr_find`). `budget_epochs`: the epochs the run was given, which the reference
    is matched on (a growing batch drops a different remainder of each epoch, so the
    epochs its sampler counted differ); None: `epochs`."""
    return {
        "task": task.name,
        "model": model,
        **{f"test_{k}": v for k, v in metrics.items()},
        "metric": task.metric,
        "steps": steps,
        "epochs": epochs,
        "samples": samples,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "k_steps": plan.k_steps,
        "world_size": world_size,
        "optimizer": strategy.optimizer_name(),
        "peak_lr": plan.peak_lr if peak_lr is None else peak_lr,
        "seed": seed,
        "wall_time_s": wall_time_s,
        "samples_per_s": samples_per_s,
        **extra,
        "reference": (reference(task.recipe(model), budget_epochs or epochs, task.metric)
                      if task.default_options else None),
        "strategy": strategy.to_dict(),
    }
