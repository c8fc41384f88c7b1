"""Elastic resume: the batch plan of a run that continues on another number of workers.

A checkpoint records the batch in force (global, micro, k_steps, world size),
the `[batch]` / `[gradient_merge]` sizes it was configured with, and the
schedule's unit (`BatchState`). `resume_plan()` picks the batch that the
resumed run uses:

- The configured sizes changed since the checkpoint: the new configuration,
  resolved for the new world size (the peak LR follows `batch.scaling`).
- Same world size: the checkpoint's batch exactly (also one an adaptive batch
  size had moved to).
- ``batch.elastic = "keep"`` (default): the checkpoint's global batch, split
  over the new workers with the largest micro batch that is not above the one
  known to fit (``batch.micro_batch_size``, else the checkpoint's) and, with
  ``gradient_merge.k_steps`` set, not above share / k_steps; merge steps make up
  the rest. Fewer workers thus merge more steps instead of growing the micro
  batch (which could run out of memory), and the noise scale keeps its
  unbiased source on one worker (first micro-step vs the merged gradient).
- ``batch.elastic = "scale"``: every worker keeps its micro batch and k_steps,
  so the global batch moves in proportion to the world size and the peak LR
  follows `batch.scaling` (linear: the Horovod convention ``lr x world_size``).

Either way the training length and the schedule keep counting steps of the
unit batch (the first run's global batch; `batch.base_batch_size` under
AdaScale): a step of another global batch advances the schedule by
``global / unit``, so the run still ends after the same number of samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["ELASTIC_MODES", "BatchState", "resume_plan", "split_batch"]

ELASTIC_MODES = ("keep", "scale")


@dataclass(frozen=True)
class BatchState:
    """What a checkpoint records of the batch (`Run.state_dict()["batch"]`)."""

    global_batch_size: int
    micro_batch_size: int
    k_steps: int
    world_size: int
    unit_batch_size: int
    """Samples of one schedule step (progress 1.0)."""
    configured: tuple[int | None, int | None, int | None]
    """(batch.global_batch_size, batch.micro_batch_size, gradient_merge.k_steps) as configured."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchState:
        return cls(**{**d, "configured": tuple(d["configured"])})

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "configured": list(self.configured)}


def configured_sizes(strategy: Any) -> tuple[int | None, int | None, int | None]:
    """The batch sizes a strategy sets (None where derived)."""
    gm = strategy.gradient_merge
    return (strategy.batch.global_batch_size, strategy.batch.micro_batch_size,
            gm.k_steps if gm.enable else 1)


def split_batch(global_batch_size: int, world_size: int, max_micro: int | None = None,
                k_steps: int | None = None) -> tuple[int, int]:
    """`(micro, k_steps)` with ``micro x k_steps x world_size == global_batch_size``.

    The largest micro batch that divides a worker's share and is not above
    `max_micro` nor, with `k_steps`, share / k_steps (so k_steps is kept when it divides).
    """
    share, rem = divmod(global_batch_size, world_size)
    if rem:
        raise ConfigError(
            f"the global batch {global_batch_size} does not split over {world_size} workers; "
            f"resume on a world size that divides it, or set batch.elastic = \"scale\""
        )
    limit = min(share, max_micro or share, max(1, share // (k_steps or 1)))
    micro = next(m for m in range(limit, 0, -1) if share % m == 0)
    return micro, share // micro


def resume_plan(strategy: Any, world_size: int, saved: BatchState | dict[str, Any]) -> Any:
    """The `BatchPlan` for resuming on `world_size` workers from a checkpoint's batch `saved`."""
    if isinstance(saved, dict):
        saved = BatchState.from_dict(saved)
    sizes = configured_sizes(strategy)
    if sizes != saved.configured:
        return strategy.resolve(world_size)
    if world_size == saved.world_size:
        g, micro, k = saved.global_batch_size, saved.micro_batch_size, saved.k_steps
    elif strategy.batch.elastic == "scale":
        micro, k = saved.micro_batch_size, saved.k_steps
        g = micro * k * world_size
    else:
        g = saved.global_batch_size
        micro, k = split_batch(g, world_size, sizes[1] or saved.micro_batch_size, sizes[2])
    return strategy.batch_plan(g, micro, k, world_size)


def resume_line(saved: dict[str, Any], plan: Any, world_size: int, unit_batch_size: int,
                strategy: Any) -> str | None:
    """What a resume did to the batch, one line (None when nothing moved)."""
    W = world_size
    g0, w0 = saved["global_batch_size"], saved["world_size"]
    if (g0, saved["micro_batch_size"], saved["k_steps"], w0) == (
            plan.global_batch_size, plan.micro_batch_size, plan.k_steps, W):
        return None
    how = (f"global batch {g0} -> {plan.global_batch_size}" if g0 != plan.global_batch_size
           else f"global batch {g0} kept")
    why = (f"{W} worker(s), was {w0}; batch.elastic={strategy.batch.elastic}" if w0 != W
           else "the batch configuration changed")
    line = f"{how} ({why}): micro batch {plan.micro_batch_size} x k_steps {plan.k_steps}"
    if g0 != plan.global_batch_size:
        line += (f", peak LR {plan.peak_lr:.6g} ({strategy.batch.scaling} scaling); the "
                 f"schedule still counts steps of {unit_batch_size} samples")
    return line
