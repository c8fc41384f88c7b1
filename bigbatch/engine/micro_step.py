"""`MicroStep`: the context a training loop enters once per micro-batch.

It turns on autocast, holds back DDP's all-reduce (`no_sync`) on all but the
k-th micro-step of a merge window, scales and counts the loss in `backward`,
and on the k-th hands over to the run's step (see `bigbatch.engine`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from bigbatch.errors import ConfigError
from bigbatch.parallel.world import all_reduce_sum

if TYPE_CHECKING:
    from bigbatch.engine.protocol import RunLike

__all__ = ["MicroStep"]


class MicroStep:
    """One micro-step: enter around forward and backward, call `backward` (or `skip`) once."""

    __slots__ = ("_run", "_contexts", "is_last", "stepped", "skipped", "_called", "_t0")

    def __init__(self, run: RunLike) -> None:
        self._run = run
        self._contexts: list[Any] = []
        self.is_last = False
        """True on the k-th micro-step, the one that all-reduces and steps."""
        self.stepped = False
        """After the block: the optimizer stepped (False while merging, and on overflow)."""
        self.skipped = False
        """After the block: the optimizer step was skipped (fp16 inf/nan gradients, `skip()`)."""
        self._called = False
        self._t0 = 0.0

    def __enter__(self) -> MicroStep:
        run = self._run
        self._t0 = time.perf_counter()
        self.is_last = run.micro == run.k_steps - 1
        if run._ddp is not None and not self.is_last:
            self._contexts.append(run._ddp.no_sync())
        if run._fsdp is not None:
            run._fsdp.set_requires_gradient_sync(self.is_last)
        if run._loss_parallel:
            from bigbatch.parallel.tensor_parallel import loss_parallel_if

            self._contexts.append(loss_parallel_if(True))
        if run.autocast_dtype is not None:
            self._contexts.append(torch.autocast(run.world.device.type, dtype=run.autocast_dtype))
        for ctx in self._contexts:
            ctx.__enter__()
        return self

    def backward(self, loss: torch.Tensor, count: float | torch.Tensor | None = None) -> None:
        """Backpropagate this micro-batch's loss with the strategy's scaling.

        `loss` is a mean over the micro-batch, or, with `count`, a sum over
        `count` items (the merged step then divides by the total count).
        """
        if self._called:
            raise RuntimeError("ms.backward() was called twice in one micro-step")
        self._called = True
        run = self._run
        mult = run._mean_mult
        if count is None:
            if run._mode == "count":
                raise ConfigError("ms.backward(): mixing count= and mean losses within one optimizer step")
            run._mode = "mean"
        else:
            if run._mode == "mean":
                raise ConfigError("ms.backward(): mixing count= and mean losses within one optimizer step")
            run._mode = "count"
            # A tensor count stays on its device: no host sync per micro-step.
            if isinstance(count, torch.Tensor):
                count = count.detach().to(torch.float64)
            run._count = run._count + count
            mult = run._count_mult
            if self.is_last and run.world.is_distributed:
                # Started before backward so it overlaps with the gradient all-reduce.
                total = torch.as_tensor(run._count, dtype=torch.float64, device=run.world.device)
                run._count_tensor = total.clone()
                run._count_work = all_reduce_sum(run._count_tensor, async_op=True,
                                                 group=run.mesh.dp_group)
        if run.local_sgd is not None:  # adaptive local SGD's interval follows the loss
            run.local_sgd.observe(loss, count)
        if mult != 1.0:
            loss = loss * mult
        if run.scaler is not None:
            loss = run.scaler.scale(loss)
        if run.autocast_dtype is not None:
            with torch.autocast(run.world.device.type, enabled=False):
                loss.backward()
        else:
            loss.backward()
        if run.timing is not None:
            run.timing.backward_done(self.is_last)

    def skip(self) -> None:
        """Instead of `backward`: drop this optimizer step (see `Run.skip_step`).

        No backward for this micro-batch; the merge window's gradients so far are
        dropped, the optimizer does not step and the schedule stays. With several
        workers every worker must skip alike (decide on an all-reduced flag).
        """
        if self._called:
            raise RuntimeError("ms.skip() after ms.backward() in one micro-step")
        self._called = True
        self.skipped = True
        self._run.skip_step()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        for ctx in reversed(self._contexts):
            ctx.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return False
        if not self._called:
            raise RuntimeError("call ms.backward(loss) inside `with run.micro_step() as ms:`")
        run = self._run
        if self.skipped:  # skip(): the window is gone
            return False
        if self.is_last:
            self.skipped = run._finish_step(self._t0)
            self.stepped = not self.skipped
        else:
            if run.micro == 0 and run._measure_first:
                run._first_sq = run._first_sq_norm(run._params)
                run._first_count = run._count
            run.micro += 1
            run._add_step_time(self._t0)
        return False
