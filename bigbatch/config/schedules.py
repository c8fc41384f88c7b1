"""Learning-rate schedules as pure functions of the optimizer step.

Shape: linear warmup over ``warmup_steps`` optimizer steps up to ``peak_lr``,
then a decay over the remaining ``total_steps - warmup_steps`` steps:

- ``"cosine"``: ``final + (peak - final) * (1 + cos(pi * p)) / 2``
- ``"poly"``:   ``final + (peak - final) * (1 - p) ** power``
- ``"step"``:   ``peak * gamma ** (number of milestones passed)``; milestone
  ``m`` (a fraction of ``total_steps``) takes effect from step
  ``round(m * total_steps)`` on (Goyal et al. divide by 10 at epochs 30, 60, 80
  of 90: milestones ``[1/3, 2/3, 8/9]``, gamma 0.1)
- ``"none"``:   ``peak``

where ``p = (step - warmup_steps) / (total_steps - warmup_steps)`` is the decay
progress clamped to [0, 1] and ``final = final_lr_ratio * peak``. Steps past
``total_steps`` keep the final value.

Warmup start (a choice, documented here once): gradual warmup (Goyal et al.
2017, arXiv:1706.02677) ramps linearly from the *base* learning rate to the
scaled peak: ``lr(t) = start + (peak - start) * t / warmup_steps``. When there
is nothing to ramp (``peak <= base``: scaling "none", or a batch no larger than
the base batch) it ramps from 0 instead, the usual linear warmup of BERT/LAMB,
so ``warmup_steps > 0`` always means a real ramp. ``lr(0)`` is the start value
and ``lr(warmup_steps)`` is the peak.

``step`` counts optimizer steps (not micro-steps, not per worker) and may be a
float (AdaScale's scale-invariant progress). Nothing here holds state: resuming
is calling ``lr(step)`` with the restored step.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bigbatch.config.scaling import scale_factor
from bigbatch.errors import ConfigError

DECAYS = ("cosine", "poly", "step", "none")
"""Names accepted for ``decay``."""

BATCH_SCHEDULES = ("fixed", "auto", "adaptive", "seesaw")
"""Names accepted for ``batch.schedule`` (how the global batch moves during a run)."""


NOISE_SCALE_FRACTIONS = {"momentum": 1.25, "adamw": 0.0075}
"""`batch.noise_scale_fraction` when unset, per optimizer family (``optimizer.type``: LARS is
momentum, LAMB is adamw): the batch doubles while twice it is at most this times the raw
gradient's noise scale. AdamW and LAMB kept their quality on charlm only far below it;
LARS on MNIST-1D from 512 to 4096 took 10.5% of the recipe's steps at 1, 9.6% at 1.25
(2 seeds, -0.2 points) and diverged on one seed at 1.5 (benchmarks/NOTES-auto-batch.md)."""


def growth_of(strategy: Any) -> str:
    """The rule a strategy's ``batch.schedule`` stands for: "fixed", "adaptive" or
    "seesaw". "auto" is the noise-scale rule (its fraction per optimizer family:
    `Strategy.noise_scale_fraction`); Seesaw under [sharding] or tensor parallelism, whose
    gradients are not whole on any worker, so the noise scale cannot be measured; and fixed
    where the batch cannot change (a pipeline, the parameter server), which the other rules
    are refused with. Reads the strategy's sections only."""
    schedule = strategy.batch.schedule
    if schedule != "auto":
        return schedule
    if strategy.pipeline.enable or strategy.parameter_server.enable:
        return "fixed"
    if strategy.sharding.enable or strategy.tensor_parallel.tensor_parallel_degree > 1:
        return "seesaw"
    return "adaptive"


def lr_factor(
    step: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_start: float = 0.0,
    decay: str = "none",
    decay_power: float = 1.0,
    decay_milestones: Sequence[float] = (),
    decay_gamma: float = 0.1,
    final_lr_ratio: float = 0.0,
) -> float:
    """Schedule value at ``step`` as a fraction of the peak learning rate.

    ``warmup_start`` is the value at step 0 as a fraction of the peak (``base_lr /
    peak_lr`` for gradual warmup, 0 for a ramp from zero). Multiply by the peak
    learning rate, or hand it to ``torch.optim.lr_scheduler.LambdaLR`` with the
    optimizer built at the peak learning rate.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps > 0 and step < warmup_steps:
        return warmup_start + (1.0 - warmup_start) * step / warmup_steps
    decay_steps = total_steps - warmup_steps
    p = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if decay == "none":
        return 1.0
    if decay == "cosine":
        return final_lr_ratio + (1.0 - final_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    if decay == "poly":
        return final_lr_ratio + (1.0 - final_lr_ratio) * (1.0 - p) ** decay_power
    if decay == "step":
        passed = sum(1 for m in decay_milestones if step >= round(m * total_steps))
        return decay_gamma**passed
    raise ValueError(f"unknown decay {decay!r}; expected one of {', '.join(DECAYS)}")


@dataclass(frozen=True)
class Schedule:
    """Warmup-then-decay learning rate, a pure function of the optimizer step.

    Use it directly, once per optimizer step::

        schedule.apply(optimizer, step)        # sets lr in every param group

    or through torch, with the optimizer built at ``peak_lr``::

        torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    """

    peak_lr: float
    """Learning rate after warmup: ``base_lr`` scaled by the batch rule."""
    total_steps: int
    """Optimizer steps in the whole run; the decay ends here."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup (0: start at the peak)."""
    warmup_start_lr: float = 0.0
    """Learning rate at step 0 when ``warmup_steps > 0``."""
    decay: str = "none"
    """One of ``cosine``, ``poly``, ``step``, ``none``."""
    decay_power: float = 1.0
    """Exponent of ``poly`` decay (1: linear)."""
    decay_milestones: tuple[float, ...] = ()
    """``step`` decay: fractions of ``total_steps`` where the LR is multiplied by gamma."""
    decay_gamma: float = 0.1
    """``step`` decay: factor applied at each milestone."""
    final_lr_ratio: float = 0.0
    """``cosine``/``poly``: final learning rate as a fraction of the peak."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "decay_milestones", tuple(self.decay_milestones))
        if self.total_steps < 1:
            raise ConfigError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ConfigError(
                f"warmup of {self.warmup_steps} steps does not fit in total_steps="
                f"{self.total_steps}; allowed 0 <= warmup steps <= total_steps"
            )
        if self.decay not in DECAYS:
            raise ConfigError(f"decay must be one of {', '.join(DECAYS)}; got {self.decay!r}")

    @classmethod
    def from_strategy(
        cls,
        strategy: Any,
        plan: Any,
        total_steps: int,
        steps_per_epoch: int | None = None,
    ) -> "Schedule":
        """Build from ``strategy.batch`` and a resolved ``BatchPlan``.

        ``total_steps`` and ``steps_per_epoch`` count optimizer steps (one per
        global batch). ``steps_per_epoch`` is needed only for
        ``batch.warmup_epochs``, which becomes ``round(warmup_epochs *
        steps_per_epoch)`` steps.
        """
        b = strategy.batch
        warmup = warmup_steps_of(b.warmup_steps, b.warmup_epochs, steps_per_epoch)
        if (rule := getattr(b, "warmup_scaling", "none")) != "none":
            warmup = grown_warmup(warmup, rule, plan.global_batch_size,
                                  b.warmup_batch_size or b.base_batch_size, total_steps)
        if total_steps >= 1 and warmup > total_steps:
            key, value = (("batch.warmup_epochs", f"{b.warmup_epochs:g}") if b.warmup_epochs
                          else ("batch.warmup_steps", str(b.warmup_steps)))
            steps = f" ({warmup} steps)" if b.warmup_epochs else ""
            raise ConfigError(
                f"{key}={value}{steps} is longer than the run's {total_steps} steps; lower "
                f"{key} (e.g. --set {key}=...) or train longer")
        return cls(
            peak_lr=plan.peak_lr,
            total_steps=total_steps,
            warmup_steps=warmup,
            warmup_start_lr=warmup_start_lr(b.base_lr, plan.peak_lr,
                                            getattr(b, "warmup_start", "base"), warmup),
            decay=b.decay,
            decay_power=b.decay_power,
            decay_milestones=tuple(b.decay_milestones),
            decay_gamma=b.decay_gamma,
            final_lr_ratio=b.final_lr_ratio,
        )

    def factor(self, step: float) -> float:
        """``lr(step) / peak_lr``: the multiplier ``LambdaLR`` expects."""
        return lr_factor(
            step,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            warmup_start=self.warmup_start_lr / self.peak_lr if self.peak_lr else 0.0,
            decay=self.decay,
            decay_power=self.decay_power,
            decay_milestones=self.decay_milestones,
            decay_gamma=self.decay_gamma,
            final_lr_ratio=self.final_lr_ratio,
        )

    def lr(self, step: float) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            # Computed in absolute terms so lr(0) is exactly warmup_start_lr.
            s = self.warmup_start_lr
            return s + (self.peak_lr - s) * step / self.warmup_steps
        return self.peak_lr * self.factor(step)

    __call__ = lr

    def apply(self, optimizer: Any, step: float) -> float:
        """Set ``lr`` of every param group of ``optimizer`` to ``lr(step)``; return it."""
        value = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = value
        return value


WARMUP_STARTS = ("base", "zero")


def warmup_start_lr(base_lr: float, peak_lr: float, start: str = "base",
                    warmup_steps: int = 0) -> float:
    """Where warmup starts (``lr(0)``).

    ``base``: ``base_lr`` when the peak is above it, else 0 (Goyal et al.: the small-batch
    recipe's rate, see module doc). ``zero``: ``peak / (warmup_steps + 1)``, so that the
    line reads ``lr(t) = peak x (t + 1) / (warmup_steps + 1)`` (nanoGPT's warmup from 0,
    without a first step at rate 0).
    """
    if start == "zero":
        return peak_lr / (warmup_steps + 1)
    return base_lr if peak_lr > base_lr else 0.0


def warmup_steps_of(warmup_steps: int, warmup_epochs: float, steps_per_epoch: int | None) -> int:
    """Warmup length in optimizer steps from either ``warmup_steps`` or ``warmup_epochs``."""
    if warmup_epochs and warmup_steps:
        raise ConfigError(
            f"batch.warmup_steps={warmup_steps} and batch.warmup_epochs={warmup_epochs} "
            "are both set; set one of them"
        )
    if not warmup_epochs:
        return int(warmup_steps)
    if steps_per_epoch is None or steps_per_epoch < 1:
        raise ConfigError(
            f"batch.warmup_epochs={warmup_epochs:g} needs the optimizer steps per epoch: pass "
            "prepare(..., samples_per_epoch=len(train_set)) or steps_per_epoch=N, or set "
            "batch.warmup_steps instead"
        )
    return round(warmup_epochs * steps_per_epoch)


def scaled_warmup(warmup_steps: int, run_steps: int, recipe_steps: int) -> int:
    """A default warmup fitted to a run shorter than the recipe's: it keeps its share.

    The task's demo schedule was chosen as a whole (mnist1d: 2 of 16 epochs of warmup,
    charlm: 1 of 4), so a short try gets the same LR curve compressed into its steps:
    ``round(warmup_steps x run_steps / recipe_steps)``, at least 1. A run as long as the
    recipe's or longer keeps the warmup as it is.
    """
    if warmup_steps <= 0 or run_steps >= recipe_steps:
        return warmup_steps
    return max(1, min(run_steps, round(warmup_steps * run_steps / recipe_steps)))


def grown_warmup(warmup_steps: int, rule: str, global_batch_size: int,
                 warmup_batch_size: int, total_steps: int) -> int:
    """Warmup that grows with the batch (``batch.warmup_scaling``): `warmup_steps` holds at
    `warmup_batch_size` and is multiplied by `rule`'s factor of the ratio of the batches
    (`bigbatch.config.scaling`), at most half of `total_steps`; as given with rule none.

    >>> grown_warmup(10, "sqrt", 4096, 1024, 1000)
    20
    """
    if rule == "none" or warmup_steps == 0:
        return warmup_steps
    grown = round(warmup_steps * scale_factor(global_batch_size / warmup_batch_size, rule))
    return max(1, min(grown, total_steps // 2))
