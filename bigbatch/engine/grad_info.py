"""What gradient hooks see at each optimizer step, and the norms behind it.

Gradient statistics (noise scale, AdaScale) need, per optimizer step, the
squared norm of a small-batch gradient and of the big-batch one. Both are
scalars: the small one is measured in DDP's comm hook before the all-reduce
(or, on one worker with gradient merge, after the first micro-step), the big
one from the reduced gradients. No gradient is copied or sent twice.
"""

from __future__ import annotations

from typing import Any

import torch

from bigbatch.optim._norms import global_norm, is_dtensor
from bigbatch.parallel.world import all_reduce_sum

__all__ = ["GradInfo", "grad_info", "small_batch_sq_norm", "sq_norm"]


def sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of a list of tensors, as one 0-d tensor (no host sync).

    Sharded or sliced tensors (DTensors) count whole: their shards' squares are
    summed over the mesh in one collective.
    """
    if not grads:
        return torch.zeros(())
    if any(is_dtensor(g) for g in grads):
        return global_norm(grads).square()
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack(norms)).square()


class GradInfo:
    """What a gradient hook sees at one optimizer step: unscaled, reduced gradients.

    Hooks run after unscaling and before the optimizer, only on steps that are
    taken (not on fp16 overflow steps). Everything here is scalars or references.
    """

    def __init__(self, step: int, params: list[torch.Tensor],
                 local_sq_norm: torch.Tensor | None, local_batch: float | None,
                 global_batch: float, pending: tuple[Any, float] | None = None,
                 big_sq_norm: torch.Tensor | None = None) -> None:
        self.step = step
        """Optimizer step about to be taken (0-based)."""
        self.params = params
        """Parameters whose `.grad` the optimizer will use (unscaled, all-reduced)."""
        self._local_sq = local_sq_norm
        self._pending = pending  # (work handle of the sum over workers, divisor)
        self.local_batch = local_batch
        """Items behind the small-batch gradient (mean over workers); None with no norm.
        With ``count=`` losses a 0-d tensor where the counts were tensors (no host read)."""
        self.global_batch = global_batch
        """Items behind the reduced gradient (a 0-d tensor as `local_batch` may be)."""
        self.big_sq_norm = big_sq_norm
        """The big-batch norm to pair with `local_sq_norm`, where the collector measured it
        (a pipeline: the whole model's, summed over stages, preconditioned as the small one);
        None: take it from `params` (`global_sq_norm`)."""
        self._global_sq: torch.Tensor | None = None

    @property
    def local_sq_norm(self) -> torch.Tensor | None:
        """Squared norm of a small-batch gradient, in the optimizer gradient's units.

        Under DDP: each worker's merged gradient before the all-reduce, |g_w|^2
        averaged over workers (the scalar all-reduce was started when this
        GradInfo was made; reading waits for it). One worker with k > 1: the
        first micro-step's gradient. None otherwise, or when measurement is off
        (`prepare(local_grad_norm=)`).
        """
        if self._pending is not None:
            work, divisor = self._pending
            if work is not None:
                work.wait()
            self._local_sq = self._local_sq / divisor
            self._pending = None
        return self._local_sq

    @property
    def has_local_sq_norm(self) -> bool:
        """Whether `local_sq_norm` is measured this step (without waiting for it)."""
        return self._local_sq is not None

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def global_sq_norm(self) -> torch.Tensor:
        """|g|^2 of the reduced gradient (computed once, a 0-d tensor)."""
        if self._global_sq is None:
            self._global_sq = sq_norm(self.grads())
        return self._global_sq


def grad_info(step: int, params: list[torch.Tensor], window: Any, scale: float,
              data_degree: int, local_raw: torch.Tensor | None, local_count: Any,
              total_count: Any) -> GradInfo:
    """This step's `GradInfo` from the window's and the comm hook's small-batch norms
    (`small_batch_sq_norm`); `scale` is the fp16 loss scale (1 without)."""
    local_sq, local_batch, global_batch, pending = small_batch_sq_norm(
        window, scale, data_degree, local_raw, local_count, total_count)
    return GradInfo(step, params, local_sq, local_batch, global_batch, pending)


def small_batch_sq_norm(window: Any, scale: float, data_degree: int,
                        local_raw: torch.Tensor | None, local_count: Any,
                        total_count: Any) -> tuple[torch.Tensor | None, float | None, float,
                                                   tuple[Any, float] | None]:
    """(small-batch |g|^2, its item count, the global item count, pending) for this step.

    Under DDP the first value is still this worker's alone: its sum over
    workers is started asynchronously and `pending` = (work, W) says how to
    finish it (wait, divide); `GradInfo.local_sq_norm` does that on first read.

    `local_raw` is the comm hook's sum of squared bucket norms (still loss-scaled
    and carrying the engine's loss multipliers). Small-batch norms are reported
    in the optimizer's gradient units: the mean gradient of their items, times k
    when avg=false (as the merged gradient is).
    """
    W, k, micro = data_degree, window.k_steps, window.micro_batch_size
    opt_factor = 1.0 if window.avg else float(k)
    count_mode = window.mode == "count"
    # Counts of count= losses may be device tensors: kept so, as no host sync is needed.
    global_batch = total_count if count_mode else float(micro * k * W)
    if local_raw is not None:  # DDP: each worker's merged gradient before the all-reduce
        if count_mode:
            unit = scale * window.count_mult * local_count / opt_factor
            local_batch = total_count / W
        else:
            unit = scale
            local_batch = float(micro * k)
        local_sq = local_raw / (unit * unit)
        return local_sq, local_batch, global_batch, (all_reduce_sum(local_sq, async_op=True), W)
    if window.first_sq is not None:  # one worker with merge: the first micro-step
        if count_mode:
            first = window.first_count
            unit = scale * window.count_mult * first / opt_factor
            local_batch = first
        else:
            unit = scale * window.mean_mult / opt_factor
            local_batch = float(micro)
        return window.first_sq / (unit * unit), local_batch, global_batch, None
    return None, None, global_batch, None
