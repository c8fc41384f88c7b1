"""`StepTiming`: this worker's compute, data-wait and sync-wait seconds per optimizer step.

A step's wall time (from the end of the previous step to the end of this one)
splits into:

- **sync wait**: time blocked on the other workers inside the micro-steps. DDP
  hides it in two places: the all-reduce at the end of backward (backward
  returns only when every bucket is reduced, so the wait is from the moment the
  last gradient is ready, measured with a post-accumulate-grad hook on every
  parameter, to the end of ``loss.backward()``), and the buffer broadcast at the
  start of forward (from DDP's forward to the wrapped module's forward);
- **compute**: the rest of the time inside the micro-step blocks (forward,
  backward, optimizer: `run.last_step_seconds` less the sync wait);
- **data wait**: the time outside the micro-step blocks (loading the next batch,
  logging), ``wall - blocks``.

A slower worker thus shows a longer compute time, while the faster ones show
the same compute time and a longer sync wait. The clocks are host clocks:
on CUDA, where neither the kernels nor NCCL's all-reduce block the host, the
split is not measured (CPU and gloo only).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StepTiming"]


class StepTiming:
    """Install with `install(run)`; call `step_done` after each step; `take()` per window."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.data = 0.0
        self.sync = 0.0
        self.steps = 0
        self._step_sync = 0.0
        self._last_grad: float | None = None
        self._outer: float | None = None
        self._last_end: float | None = None
        self._handles: list[Any] = []

    def install(self, run: Any) -> None:
        """Hook into `run`'s model (DDP only: without it no worker waits for another)."""
        run.timing = self
        ddp = run.model if run.model is not run.module else None
        if ddp is None or self._handles:
            return
        clock = time.perf_counter

        def grad_ready(_param: Any) -> None:
            self._last_grad = clock()

        def outer(_module: Any, _args: Any) -> None:
            self._outer = clock()

        def inner(_module: Any, _args: Any) -> None:
            if self._outer is not None:  # DDP's pre-forward: the buffer broadcast
                self._step_sync += clock() - self._outer
                self._outer = None

        self._handles = [p.register_post_accumulate_grad_hook(grad_ready) for p in run.params]
        self._handles.append(ddp.register_forward_pre_hook(outer))
        self._handles.append(run.module.register_forward_pre_hook(inner))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def backward_done(self, synced: bool) -> None:
        """`loss.backward()` returned; `synced`: it all-reduced (the merge window's last)."""
        if synced and self._last_grad is not None:
            self._step_sync += max(0.0, time.perf_counter() - self._last_grad)
        self._last_grad = None

    def step_done(self, block_seconds: float) -> None:
        """An optimizer step ended; `block_seconds`: its time inside the micro-step blocks."""
        now = time.perf_counter()
        sync = min(self._step_sync, block_seconds)
        self.compute += block_seconds - sync
        self.sync += sync
        if self._last_end is not None:
            self.data += max(0.0, now - self._last_end - block_seconds)
        self.steps += 1
        self._step_sync = 0.0
        self._last_end = now

    def add_sync(self, seconds: float) -> None:
        """Waiting for the other workers outside the micro-steps (a gather of timings)."""
        self.sync += seconds
        self.data -= seconds

    def take(self) -> tuple[float, float, float, int]:
        """(compute, data, sync seconds, steps) since the last `take`, and restart."""
        out = (self.compute, max(0.0, self.data), self.sync, self.steps)
        self.compute = self.data = self.sync = 0.0
        self.steps = 0
        return out
