"""A schedule as a torch ``LRScheduler`` that counts optimizer steps, not calls.

``ScheduleLR(optimizer, schedule)`` sets every param group's ``lr`` to its initial
``lr`` times ``schedule.factor(step)`` (a ``bigbatch.Schedule``, or any function of the
step returning that factor), where ``step`` is the number of optimizer steps taken: one
per global batch. Build the optimizer at the schedule's peak LR
(``bigbatch.build_optimizer`` does).

Why it counts steps itself: trainers call ``scheduler.step()`` on their own terms.
Accelerate's ``prepare(..., scheduler)`` calls it once per process for every optimizer
step (``step_scheduler_with_optimizer=True``, the default, without ``split_batches``),
so a plain ``LambdaLR`` of the run's length reaches its end N times too early on N
ranks. Here each call moves the schedule to the optimizer's step count (a post-hook on
``optimizer.step`` counts them): calls with no optimizer step in between change nothing
(the first such call warns once), and a scheduler stepped less often catches up. A step
the optimizer skipped (``GradScaler`` on an overflow never calls it) does not count,
as the schedule of ``prepare``'s run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["ScheduleLR"]


class ScheduleLR(LRScheduler):
    """``lr = initial lr x schedule.factor(optimizer steps taken)`` for every group.

    Args:
        optimizer: the optimizer, built at the schedule's peak learning rate.
        schedule: a ``bigbatch.Schedule`` (its ``factor`` is used), or a function of the
            step returning the factor.
        last_epoch: torch's; leave -1 and restore with ``load_state_dict``.

    ``last_epoch`` is the number of optimizer steps taken (``get_last_lr`` the LR of the
    next one). ``extra_calls`` counts ``step()`` calls that found no new optimizer step.
    ``state_dict()`` holds numbers only (the schedule is not saved: build it again).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Any, last_epoch: int = -1):
        factor = getattr(schedule, "factor", schedule)
        if not callable(factor):
            raise TypeError(f"ScheduleLR: schedule={schedule!r} should be a bigbatch.Schedule "
                            "or a function of the step")
        self._factor: Callable[[float], float] = factor
        self._taken = 0  # optimizer steps since the last step() that moved the schedule
        self.extra_calls = 0
        self._hook = optimizer.register_step_post_hook(self._count)
        super().__init__(optimizer, last_epoch)

    def _count(self, optimizer, args, kwargs) -> None:
        self._taken += 1

    def step(self, epoch: int | None = None) -> None:  # noqa: D102 (torch's)
        if epoch is not None:
            raise TypeError("ScheduleLR.step() takes no epoch: it counts optimizer steps")
        if self.last_epoch < 0:  # torch's first call from __init__: step 0's LR
            super().step()
            return
        if self._taken == 0:
            self.extra_calls += 1
            if self.extra_calls == 1:
                warnings.warn(
                    "ScheduleLR.step() was called with no optimizer step since the last "
                    "call: it follows the optimizer's step count, so extra calls change "
                    "nothing (Accelerate calls it once per process per optimizer step)",
                    UserWarning, stacklevel=2)
            return
        self.last_epoch += self._taken - 1  # torch's step adds the last one
        self._taken = 0
        super().step()

    def remove(self) -> None:
        """Stop counting the optimizer's steps (the scheduler is done with it)."""
        self._hook.remove()

    def get_lr(self) -> list[float]:
        factor = self._factor(self.last_epoch)
        return [base * factor for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k not in ("_factor", "_hook")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = {k: v for k, v in state_dict.items() if k not in ("_factor", "_hook")}
        super().load_state_dict(state)
