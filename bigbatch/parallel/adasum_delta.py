"""Adasum where Horovod applies it: on the optimizer's update for Adam-type optimizers.

Horovod's Adasum optimizer does not combine gradients. Each worker steps its own optimizer
on its own gradient, takes the change it made to every weight (the *delta*), Adasum-reduces
the deltas, and sets every weight to its value before the step plus the combined delta.
The paper (Maleki et al. 2021, section 4) explains why: Adam's and LAMB's update is not a
linear function of the gradient, and Adasum's orthogonality test is meaningful on the step
each worker would actually take. For momentum SGD (and LARS) the update is linear in the
gradient and Adasum on gradients is what the paper evaluates; `adasum_target` picks:

    data_parallel.adasum_on = "auto"      delta for optimizer.type = "adamw" (AdamW, LAMB,
                                          Muon + AdamW), gradient for "momentum" (SGD, LARS)
                            = "gradient"  the DDP hook combines gradients (as before)
                            = "delta"     this module, whatever the optimizer

What one worker's step does under ``delta``::

    start = w
    w' = optimizer.step(w, g_local)            # this worker's moments, its own gradient
    w  = start + adasum_over_workers(w' - start)   # per parameter tensor

The DDP hook leaves each gradient local (`keep_local_hook`), so a worker's optimizer state
(Adam's moments, momentum) is built from its own gradients, as in Horovod; `synchronize`
averages it across workers before a checkpoint is taken so that what is saved is what
every worker resumes from (the same rule as local SGD's).

The LR rule Horovod documents for Adasum: the best learning rate of *one* worker, not the
batch-scaled one (`data_parallel.adasum_lr = "worker"`, the default; see
`bigbatch.config.strategy.Strategy.batch_plan`). Horovod multiplies it by the GPUs per node
only in its hierarchical mode, where NCCL *averages* inside a node first; bigbatch runs
Adasum across every worker, so that factor is 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.adaptive.adasum import adasum_allreduce
from bigbatch.config.comm import adasum_target

__all__ = ["AdasumDelta", "adasum_target", "keep_local_hook"]


def keep_local_hook(state, bucket):  # DDP inspects annotations; postponed ones fail its check
    """DDP comm hook that communicates nothing: each worker keeps its own gradient."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class AdasumDelta:
    """Adasum over the workers of each optimizer step's weight change, per parameter tensor.

    Installs a pre-step hook (remember the weights) and a post-step hook (reduce the change)
    on `optimizer`, torch's own hook points, so the optimizer class is untouched. Every
    worker must step together: the post-step hook is a collective.
    """

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                 group: Any = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = optimizer
        self.group = group
        self._start: list[torch.Tensor] | None = None
        self.steps = 0
        """Optimizer steps whose deltas were combined."""
        self._handles = [optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after)]

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            if self._start is None:
                self._start = [p.detach().clone() for p in self.params]
            else:
                torch._foreach_copy_(self._start, [p.detach() for p in self.params])

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        start = self._start
        if start is None:
            return
        with torch.no_grad():
            deltas = torch._foreach_sub([p.detach() for p in self.params], start)
            by_dtype: dict[tuple[torch.dtype, torch.device], list[int]] = {}
            for i, d in enumerate(deltas):
                by_dtype.setdefault((d.dtype, d.device), []).append(i)
            for idx in by_dtype.values():  # one message per round for each dtype
                adasum_allreduce([deltas[i] for i in idx], self.group)
            torch._foreach_add_(start, deltas)
            torch._foreach_copy_([p.detach() for p in self.params], start)
        self.steps += 1

    def synchronize(self) -> None:
        """Average the workers' optimizer state (moments, momentum) now; weights agree already."""
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
        if not state or not dist.is_initialized():
            return
        n = dist.get_world_size(self.group)
        for t in state:
            dist.all_reduce(t, group=self.group)
            t.div_(n)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def stats(self) -> dict[str, float]:
        return {"adasum_delta_steps": float(self.steps)}
