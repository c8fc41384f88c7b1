"""`BatchControl`: the one owner of the batch in force and of its changes.

``global = micro x k_steps x data degree``. A change (goodput, a policy, an
elastic resume) goes through `BatchControl.set`, which resizes the merge window,
re-peaks the schedule clock and tells its listeners (the `[adaptive]` controller).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bigbatch.engine.clock import ScheduleClock
from bigbatch.engine.merge import MergeWindow
from bigbatch.errors import ConfigError

__all__ = ["BatchControl"]


class BatchControl:
    """The `BatchPlan` in force (`plan`), the record of its changes (`changes`), and `set`."""

    def __init__(self, plan: Any, strategy: Any, data_degree: int, window: MergeWindow,
                 clock: ScheduleClock, fixed: bool = False) -> None:
        self.plan = plan
        """The BatchPlan in force (global/micro batch, k_steps, peak_lr)."""
        self.changes: list[dict[str, Any]] = []
        """Policy decisions that changed the batch: step, old, new, micro, k, reason."""
        self.listeners: list[Callable[[], None]] = []
        """Called after every change."""
        self._strategy = strategy
        self._data_degree = data_degree
        self._window = window
        self._clock = clock
        self._fixed = fixed  # a pipeline's schedule: its micro-batch count and shapes

    def set(self, micro_batch_size: int, k_steps: int) -> None:
        """``global = micro x k_steps x data degree`` from the next optimizer step on; the
        peak LR follows `batch.scaling` and a step advances the schedule by global / unit."""
        window = self._window
        if window.micro:
            raise RuntimeError("run.set_batch() inside a merge window; call it after the "
                               "optimizer step (ms.stepped)")
        if self._fixed and (micro_batch_size, k_steps) != (window.micro_batch_size,
                                                           window.k_steps):
            raise ConfigError(
                f"run.set_batch({micro_batch_size}, {k_steps}) under [pipeline]: the schedule "
                f"runs {window.k_steps} micro-batches of {window.micro_batch_size} "
                f"(pipeline.accumulate_steps, micro_batch_size), fixed for the run")
        W = self._data_degree
        self.plan = plan = self._strategy.batch_plan(micro_batch_size * k_steps * W,
                                                     micro_batch_size, k_steps, W)
        window.resize(plan.micro_batch_size, plan.k_steps)
        self._clock.rescale(plan, self._strategy)
        for listener in self.listeners:
            listener()

    def double(self, max_micro_batch_size: int) -> tuple[int, int]:
        """Twice the global batch from the next optimizer step on: the micro batch doubles
        while it stays within `max_micro_batch_size` (memory), merge steps beyond.
        Returns the new ``(micro_batch_size, k_steps)``."""
        m, k = self.plan.micro_batch_size, self._window.k_steps
        m, k = (2 * m, k) if 2 * m <= max_micro_batch_size else (m, 2 * k)
        self.set(m, k)
        return m, k
