"""``batch.schedule = "adaptive"`` or ``"seesaw"`` on the engine: the built-in policy that
grows the global batch during a run.

The run starts at `Strategy.start_plan` (``batch.start_batch_size``) and the configured
global batch is the ceiling (`Strategy.ceiling`). Every ``batch.schedule_interval_steps``
optimizer steps the policy asks its rule (`bigbatch.adaptive.batch_growth`) and, on a
yes, doubles the batch through `BatchControl.double`: the micro batch grows up to the
ceiling's (memory), merge steps beyond, so the change works under data parallelism,
ZeRO and tensor parallelism alike, and the peak LR follows ``batch.scaling``. The
schedule counts samples (`ScheduleClock.rescale`), so warmup and decay end with the
sample budget whatever the batch did.

"adaptive" reads the noise scale of the `[adaptive]` controller, which prepare()
switches on for it; a decision waits for `MIN_ESTIMATES` estimates after the
estimator's warm-up (`adaptive.gns_warmup_steps`). Every worker applies rank 0's
decision. "seesaw" reads only the schedule, the same on every worker.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch.distributed as dist

from bigbatch.adaptive.batch_growth import NoiseScaleGrowth, SeesawGrowth
from bigbatch.adaptive.policy import Policy
from bigbatch.config.schedules import growth_of
from bigbatch.errors import ConfigError

__all__ = ["MIN_ESTIMATES", "BatchSchedulePolicy", "decay_factor"]

log = logging.getLogger("bigbatch.adaptive")

MIN_ESTIMATES = 10
"""Per-step noise estimates the tracker must hold before "adaptive" trusts its average."""


def decay_factor(schedule: Any, progress: float) -> float:
    """The decay's share of the peak LR at `progress` (1 during warmup)."""
    if progress < schedule.warmup_steps or schedule.peak_lr <= 0:
        return 1.0
    return schedule.lr(progress) / schedule.peak_lr


class BatchSchedulePolicy(Policy):
    """``batch_schedule``: grows the batch as ``batch.schedule`` says (see the module)."""

    name = "batch_schedule"

    def __init__(self, mode: str, noise_scale_fraction: float = 1.0,
                 interval_steps: int = 10) -> None:
        if mode not in ("adaptive", "seesaw"):
            raise ConfigError(f'batch.schedule={mode!r}: the policy grows "adaptive" or '
                              '"seesaw" batches')
        self.mode = mode
        self.interval_steps = int(interval_steps)
        self.noise_rule = NoiseScaleGrowth(noise_scale_fraction)
        self.seesaw_rule = SeesawGrowth()
        self.start = self.ceiling = self.max_micro = 0

    @classmethod
    def from_strategy(cls, strategy: Any) -> BatchSchedulePolicy:
        b = strategy.batch
        return cls(growth_of(strategy), strategy.noise_scale_fraction,
                   b.schedule_interval_steps)

    def setup(self, run: Any) -> None:
        if self.mode == "adaptive" and run.adaptive is None:
            raise ConfigError('batch.schedule = "adaptive" needs the noise scale, which '
                              "prepare() tracks for it; the run has no [adaptive] controller")
        ceiling = run.strategy.ceiling(run.mesh.data_degree)
        self.start = run.strategy.start_plan(ceiling).global_batch_size
        self.ceiling = ceiling.global_batch_size
        if run.adaptive is not None:  # the data set bounds it too (`limit_batch_size`)
            self.ceiling = min(self.ceiling, run.adaptive.batch_limit)
        self.max_micro = max(ceiling.micro_batch_size, run.plan.micro_batch_size)

    def after_step(self, run: Any, stats: dict[str, float]) -> None:
        if run.step % self.interval_steps:
            return
        batch = run.plan.global_batch_size
        if self.mode == "seesaw":
            factor = decay_factor(run.clock.schedule, run.clock.progress)
            new = self.seesaw_rule.decide(factor, batch, self.start, self.ceiling)
            why = f"the decay reached {factor:.3g} of the peak LR"
        else:
            noise = self._noise_scale(run)
            new = self.noise_rule.decide(noise, batch, self.ceiling)
            why = (f"noise scale {noise:.4g} x fraction {self.noise_rule.fraction:g} = "
                   f"{self.noise_rule.target(noise):.4g} >= {new}")
        if new is None:
            return
        while run.plan.global_batch_size < new:
            micro, k = run.batch.double(self.max_micro)
        reason = (f"{why}: global batch {batch} -> {run.plan.global_batch_size} (micro "
                  f"{micro} x {k} steps), peak LR {run.plan.peak_lr * run.clock.peak_factor:.4g}")
        run.batch_size_changes.append({"step": run.step, "old": batch,
                                       "new": run.plan.global_batch_size,
                                       "micro_batch_size": micro, "k_steps": k,
                                       "reason": reason})
        if run.world.is_main:
            log.info("step %d: %s", run.step, reason)

    @staticmethod
    def _noise_scale(run: Any) -> float:
        ctl = run.adaptive
        ctl.flush()
        t = ctl.tracker
        noise = [float(t.b_simple) if t.steps >= MIN_ESTIMATES else math.nan]
        if run.world.is_distributed and dist.is_initialized():
            dist.broadcast_object_list(noise, src=0)  # one decision for every worker
        return noise[0]
