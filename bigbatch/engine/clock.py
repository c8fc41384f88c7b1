"""`ScheduleClock`: the one owner of a run's learning rate and of how far it has got.

The LR the optimizer sees is ``schedule.lr(progress) * lr_scale`` times a param
group's own ``lr_scale``. Everything that moves one of those factors goes through
this object's methods: the step (`advance`), a batch change (`rescale`), AdaScale
(`set_gain`), a policy (`set_lr_scale`), the LR range test (`set_peak_lr`) and a resume
(`load_state_dict`). `apply` is the only code that writes ``param_group["lr"]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bigbatch.config.schedules import warmup_start_lr

__all__ = ["ScheduleClock"]

_STATE_KEYS = ("step", "skipped_steps", "progress", "progress_rate", "lr_scale", "peak_factor")


class ScheduleClock:
    """Schedule, progress and step counters, and the LR they give.

    `progress` advances by `progress_rate` per optimizer step taken, in steps of
    `unit_batch_size` samples; the run is `done` once it reaches `total_steps`.
    """

    def __init__(self, schedule: Any, optimizer: torch.optim.Optimizer, *, total_steps: int,
                 unit_batch_size: int) -> None:
        self._base = schedule
        self._optimizer = optimizer
        self.schedule = schedule
        """`Schedule` in force: the configured one, re-peaked after a batch change."""
        self.total_steps = int(total_steps)
        """Training length in schedule units."""
        self.unit_batch_size = int(unit_batch_size)
        """Samples of one schedule unit (the first run's global batch; AdaScale: the base batch)."""
        self.step = 0
        """Optimizer steps taken (skipped overflow steps excluded, except those skipped on
        the device: `advance_flagged`)."""
        self._held = 0
        # Overflow flags of `advance_flagged` steps, summed on the device (None: none yet).
        self._flagged: torch.Tensor | None = None
        self.progress = 0.0
        """Where the schedule is read."""
        self.progress_rate = 1.0
        """Schedule units per step taken (AdaScale's gain; global / unit after a batch change)."""
        self.lr_scale = 1.0
        """Multiplier on top of the schedule (AdaScale, policies)."""
        self.peak_factor = 1.0
        """The range test's peak LR over the configured one (`batch.lr_find`); 1: none."""
        self.last_lr = schedule.lr(0)
        """The LR of the latest `apply` (before a group's own ``lr_scale``)."""
        self.apply()

    def lr_at(self, progress: float) -> float:
        """The LR at schedule position `progress` (times `lr_scale`)."""
        return self.schedule.lr(progress) * self.lr_scale

    @property
    def done(self) -> bool:
        return self.progress >= self.total_steps

    def apply(self) -> float:
        """Write the LR of the current position into the optimizer's param groups."""
        self.last_lr = lr = self.lr_at(self.progress)
        # A group's own "lr_scale" (e.g. in a user's optimizer) multiplies the schedule's LR.
        for group in self._optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr

    def advance(self) -> None:
        """One optimizer step was taken."""
        self.step += 1
        self.progress += self.progress_rate

    def skip(self) -> None:
        """One optimizer step was skipped (non-finite gradients): the schedule stays."""
        self._held += 1

    def advance_flagged(self, overflow: torch.Tensor) -> None:
        """A step whose overflow flag stays on the device (fp16, `Run.device_skip`): the
        optimizer skipped the update there or not, the schedule advances either way (as a
        plain torch loop's LR scheduler does), and the flag adds to `skipped_steps`."""
        flag = (overflow > 0).to(torch.int64)
        self._flagged = flag if self._flagged is None else self._flagged + flag
        self.advance()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of inf/nan gradients (reads the device when
        some were flagged there)."""
        return self._held + (int(self._flagged) if self._flagged is not None else 0)

    def set_gain(self, lr_scale: float, progress_rate: float) -> None:
        """AdaScale: this step's LR multiplier and the schedule units it counts for."""
        self.lr_scale = float(lr_scale)
        self.progress_rate = float(progress_rate)

    def set_lr_scale(self, lr_scale: float) -> None:
        """A multiplier on the schedule from the next step on (a policy's decision)."""
        self.lr_scale = float(lr_scale)

    def rescale(self, plan: Any, strategy: Any) -> None:
        """A new global batch: the peak follows `batch.scaling` (`plan.peak_lr`, times
        `peak_factor`), warmup keeps its start rule, and a step counts ``global / unit``
        schedule units."""
        self._repeak(plan.peak_lr * self.peak_factor, strategy)
        self.progress_rate = plan.global_batch_size / self.unit_batch_size

    def set_peak_lr(self, peak_lr: float, strategy: Any) -> None:
        """`batch.lr_find`: `peak_lr` in place of the peak the schedule has for the batch in
        force; a later batch change scales it by `batch.scaling` as it would the configured
        one. Warmup keeps its start rule; the LR is written at once."""
        configured = self.schedule.peak_lr / self.peak_factor
        self._set_peak_factor(peak_lr / configured, strategy)

    def _set_peak_factor(self, factor: float, strategy: Any) -> None:
        configured = self.schedule.peak_lr / self.peak_factor
        self.peak_factor = float(factor)
        self._repeak(configured * self.peak_factor, strategy)
        self.apply()

    def _repeak(self, peak_lr: float, strategy: Any) -> None:
        b = strategy.batch
        self.schedule = dataclasses.replace(
            self._base, peak_lr=peak_lr,
            warmup_start_lr=warmup_start_lr(b.base_lr, peak_lr, b.warmup_start,
                                            self._base.warmup_steps))

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def load_state_dict(self, state: dict[str, Any], strategy: Any = None) -> None:
        """Counters and position from a checkpoint (`rescale` afterwards if the batch moved);
        with `strategy`, also the range test's peak (`peak_factor`; 1 in checkpoints older
        than `batch.lr_find`). The LR is written again at once."""
        if strategy is not None:
            self._set_peak_factor(float(state.get("peak_factor", 1.0)), strategy)
        self.step = int(state["step"])
        self._held, self._flagged = int(state["skipped_steps"]), None
        self.progress = float(state["progress"])
        self.progress_rate = float(state["progress_rate"])
        self.lr_scale = float(state["lr_scale"])
