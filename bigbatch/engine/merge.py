"""`MergeWindow`: the one owner of gradient merge's bookkeeping.

A window is `k_steps` micro-steps whose gradients add up in ``.grad`` before one
optimizer step. The window knows which micro-step is current, how each loss is
scaled (mean losses by ``1/k``, ``count=`` losses by a constant until the step
divides by the total count), the running item count and its all-reduce, when the
data-parallel gradient sync happens (DDP's `no_sync`, FSDP2's
`set_requires_gradient_sync`: on the last micro-step only), and, on one worker,
the first micro-step's gradient norm for the noise scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bigbatch.engine.grad_info import sq_norm
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import all_reduce_sum

__all__ = ["MergeWindow", "grads_sq_norm"]

_MIXED = "ms.backward(): mixing count= and mean losses within one optimizer step"


def grads_sq_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Squared norm of the parameters' gradients (the first micro-step's measure)."""
    return sq_norm([p.grad for p in params if p.grad is not None])


class MergeWindow:
    """Micro-step position, loss scaling and gradient sync of one optimizer step.

    `k_steps` and `micro_batch_size` follow the batch in force (`resize`);
    `micro_batch_sizes` holds per-data-rank micro batches when they differ
    (straggler rebalancing), else None.
    """

    def __init__(self, *, k_steps: int, micro_batch_size: int, avg: bool, data_rank: int,
                 params: list[torch.Tensor], device: torch.device, distributed: bool,
                 dp_group: Any = None, ddp: nn.Module | None = None,
                 fsdp: nn.Module | None = None, measure_first: bool = False) -> None:
        self.k_steps = int(k_steps)
        self.micro_batch_size = int(micro_batch_size)
        self.micro_batch_sizes: list[int] | None = None
        self.avg = bool(avg)
        self._data_rank = data_rank
        self._params = params
        self._device = device
        self._distributed = distributed
        self._dp_group = dp_group
        self._ddp = ddp
        self._fsdp = fsdp
        self._measure_first = measure_first
        self._first_norm: Callable[[list[torch.Tensor]], torch.Tensor] = grads_sq_norm
        self.reset()

    # ------------------------------------------------------------- the window

    def reset(self) -> None:
        """A new window: no micro-step taken, no loss counted."""
        self.micro = 0
        self.mode: str | None = None
        """"mean" or "count" once the window's first loss is in (they don't mix)."""
        self.count: float | torch.Tensor = 0.0
        """This worker's items so far (``count=`` losses)."""
        self._count_total: torch.Tensor | None = None
        self._count_work: Any = None
        self.first_sq: torch.Tensor | None = None
        """On one worker measuring the noise scale: the first micro-step's |g|^2."""
        self.first_count: float | torch.Tensor = 0.0

    @property
    def is_last(self) -> bool:
        return self.micro == self.k_steps - 1

    def resize(self, micro_batch_size: int, k_steps: int) -> None:
        """Another batch from the next window on (call between windows)."""
        self.micro_batch_size, self.k_steps = int(micro_batch_size), int(k_steps)
        self.micro_batch_sizes = None

    def measure_first_with(self, norm: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        """How the first micro-step's squared norm is taken (preconditioned for Adam)."""
        self._first_norm = norm

    def set_ddp(self, ddp: nn.Module | None) -> None:
        """The DDP wrapper whose sync the window holds back (None once it is torn down)."""
        self._ddp = ddp

    # Read per micro-step rather than cached so that a batch change between optimizer
    # steps (adaptive batch size) takes effect at once.
    @property
    def mean_mult(self) -> float:
        """What a mean loss is multiplied by before backward."""
        mult = 1.0 / self.k_steps if self.avg else 1.0
        if self.micro_batch_sizes is not None:  # the workers' mean, weighted by samples
            mult *= self.micro_batch_sizes[self._data_rank] / self.micro_batch_size
        return mult

    @property
    def count_mult(self) -> float:
        """What a summed (``count=``) loss is multiplied by before backward: a constant that
        keeps fp16 gradients at mean-loss magnitudes; the step applies 1/total count."""
        return 1.0 / self.micro_batch_size

    # ------------------------------------------------------------- one micro-step

    def sync_contexts(self) -> list[Any]:
        """Enter the current micro-step: gradient sync on the window's last only. Returns
        the contexts to enter around forward and backward."""
        last = self.is_last
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(last)
        if self._ddp is not None and not last:
            return [self._ddp.no_sync()]
        return []

    def loss_multiplier(self, count: float | torch.Tensor | None) -> float:
        """Count this micro-step's loss in; the factor it is multiplied by."""
        if count is None:
            if self.mode == "count":
                raise ConfigError(_MIXED)
            self.mode = "mean"
            return self.mean_mult
        if self.mode == "mean":
            raise ConfigError(_MIXED)
        self.mode = "count"
        # A tensor count stays on its device: no host sync per micro-step.
        if isinstance(count, torch.Tensor):
            count = count.detach().to(torch.float64)
        self.count = self.count + count
        if self.is_last and self._distributed:
            # Started before backward so it overlaps with the gradient all-reduce.
            total = torch.as_tensor(self.count, dtype=torch.float64, device=self._device)
            self._count_total = total.clone()
            self._count_work = all_reduce_sum(self._count_total, async_op=True,
                                              group=self._dp_group)
        return self.count_mult

    def set_counts(self, count: float, total: torch.Tensor) -> None:
        """A window counted elsewhere (a pipeline's step): this worker's items and the
        global item count."""
        self.mode = "count"
        self.count = float(count)
        self._count_total = total

    def end_micro(self) -> None:
        """A micro-step before the last is done: on one worker measuring the noise scale,
        take the first one's norm."""
        if self.micro == 0 and self._measure_first:
            self.first_sq = self._first_norm(self._params)
            self.first_count = self.count
        self.micro += 1

    # ------------------------------------------------------------- the step

    def total_count(self) -> float | torch.Tensor:
        """The step's item count over all workers (waits for its all-reduce)."""
        if self._count_work is not None:
            self._count_work.wait()
            self._count_work = None
        total = self._count_total if self._count_total is not None else self.count
        if not isinstance(total, torch.Tensor) and total <= 0:
            raise ValueError("ms.backward(count=...): the total count over the optimizer step is 0")
        return total

    def grad_factor(self, data_degree: int) -> float | torch.Tensor:
        """What the step multiplies the reduced gradients by: with ``count=`` losses the
        count normalisation (1 for mean losses). A tensor keeps it free of host syncs."""
        if self.mode != "count":
            return 1.0
        factor = data_degree / (self.count_mult * self.total_count())
        return factor if self.avg else factor * self.k_steps

    # ------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """``micro``, ``k_steps``, ``micro_batch_sizes``, and mid-window this worker's
        accumulated gradients (``window``)."""
        state: dict[str, Any] = {"micro": self.micro, "k_steps": self.k_steps,
                                 "micro_batch_sizes": self.micro_batch_sizes}
        if self.micro:
            state["window"] = {
                "mode": self.mode,
                "count": self.count,
                "grads": [None if p.grad is None else p.grad.detach().clone()
                          for p in self._params],
            }
        return state

    def load_window(self, state: dict[str, Any]) -> None:
        """A window caught mid-way: its position, count and gradients."""
        window = state.get("window")
        if window is None:
            return
        self.micro = int(state["micro"])
        self.mode = window["mode"]
        self.count = float(window["count"])
        for p, g in zip(self._params, window["grads"], strict=True):
            p.grad = None if g is None else g.to(p.device).clone()

    def load_micro_batch_sizes(self, sizes: list[int] | None, data_degree: int) -> None:
        """Uneven micro batches from a checkpoint, if the workers are the same (else even)."""
        if sizes is not None and len(sizes) == data_degree and (
                sum(sizes) == self.micro_batch_size * data_degree):
            self.micro_batch_sizes = [int(x) for x in sizes]
