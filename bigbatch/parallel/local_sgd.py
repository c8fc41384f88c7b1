"""Local SGD: after `begin_step` synchronous steps, workers step alone on their own
micro-batches and average their models every k steps (post-local SGD, Lin et al. 2020).

The gradient side is torch's `post_localSGD_hook` (all-reduce until `begin_step`, then
nothing); the model side is torch's `PeriodicModelAverager`, or for
`[adaptive_localsgd]` an averager whose interval follows Fleet's rule

    k = clamp(ceil(sqrt(lr_0 x loss / (lr x loss_0) x init_k_steps)), 1, 16)

with `loss` the workers' mean loss of the averaging step and `lr_0`, `loss_0` those of step 1.
`[localsgd] averaging = "pairwise"` averages each worker with one peer instead of all
(`bigbatch.parallel.pairwise_averaging`), on the same schedule of steps.

Semantics that differ from data parallelism, by design:
- Each worker's optimizer state (momentum, Adam moments) stays its own between
  averages; only the weights are averaged. For momentum SGD with k = 1 this is DDP
  (the mean of the workers' momenta is DDP's momentum); with LARS/LAMB the trust ratio
  is taken on each worker's local gradient and weights.
- Gradient merge merges micro-steps locally: a local step is micro x k_steps samples
  per worker; the LR is that of the global batch, as Fleet keeps it.
- `synchronize()` averages weights and optimizer state over all workers now (pairwise
  averaging too): `Run.state_dict()` calls it,
  so a checkpoint holds the state every worker has, and evaluation calls it, so the
  evaluated model is the average. A resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging import utils as averaging
from torch.distributed.algorithms.model_averaging.averagers import (
    ModelAverager,
    PeriodicModelAverager,
)

from bigbatch.parallel.pairwise_averaging import PairwiseAverager

__all__ = ["MAX_ADAPTIVE_K", "AdaptiveAverager", "LocalSGD", "adaptive_interval"]

MAX_ADAPTIVE_K = 16
"""Fleet's bound on the adaptive interval."""


def adaptive_interval(init_k: int, lr_0: float, loss_0: float, lr: float, loss: float) -> int:
    """Fleet's adaptive local SGD interval (its `communicate_avg_loss`)."""
    if lr <= 0 or loss_0 <= 0 or not math.isfinite(loss):
        return MAX_ADAPTIVE_K if lr <= 0 else 1
    k = math.ceil(math.sqrt(lr_0 * loss / (lr * loss_0) * init_k))
    return min(MAX_ADAPTIVE_K, max(1, k))


class AdaptiveAverager(ModelAverager):
    """Averages after every k-th local step, k re-chosen at each average from the loss."""

    def __init__(self, init_k_steps: int, begin_step: int, group: Any = None) -> None:
        super().__init__(group)
        self.init_k = int(init_k_steps)
        self.begin = int(begin_step)
        self.k = self.init_k
        """Local steps in the current interval."""
        self.last = self.begin
        """Step of the latest average (the synchronous phase ends at `begin_step`)."""
        self.lr_0: float | None = None
        self.loss_0: float | None = None

    def average_parameters(self, params: Any, step: int = 0, lr: float = 0.0,
                           loss: torch.Tensor | None = None) -> bool:
        """After optimizer step `step` (1-based): average when the interval is over.
        `loss`: this worker's mean loss of the step. True if it averaged."""
        self.step = step
        if step == 1:
            self.lr_0, self.loss_0 = lr, self._mean(loss)
        if step <= self.begin or step - self.last < self.k:
            return False
        averaging.average_parameters(iter(params), self.process_group)
        self.k = adaptive_interval(self.init_k, self.lr_0 or lr, self.loss_0 or 0.0, lr,
                                   self._mean(loss))
        self.last = step
        return True

    def _mean(self, loss: torch.Tensor | None) -> float:
        if loss is None:
            return float("nan")
        t = loss.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(t, group=self.process_group)
        return float(t) / dist.get_world_size(self.process_group)

    def state_dict(self) -> dict[str, Any]:
        return {"k": self.k, "last": self.last, "lr_0": self.lr_0, "loss_0": self.loss_0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.k, self.last = int(state["k"]), int(state["last"])
        self.lr_0, self.loss_0 = state["lr_0"], state["loss_0"]


class LocalSGD:
    """A run's local SGD: the DDP comm hook to install, and what happens after each step."""

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 config: Any, group: Any = None) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.group = group
        self.adaptive = config.section == "adaptive_localsgd"
        self.pairs: PairwiseAverager | None = None
        """The hypercube averager under averaging = "pairwise" (else all workers average)."""
        if not self.adaptive and config.averaging == "pairwise":
            self.pairs = PairwiseAverager(group)
        begin = int(config.begin_step)
        self.hook_state = PostLocalSGDState(process_group=group, subgroup=None,
                                            start_localSGD_iter=begin,
                                            post_local_gradient_allreduce=False)
        if self.adaptive:
            self.averager: ModelAverager = AdaptiveAverager(config.init_k_steps, begin, group)
        else:
            k = int(config.k_steps)
            with warnings.catch_warnings():  # k = 1 is allowed: it is DDP, the reference case
                warnings.simplefilter("ignore")
                # Call i (0-based) follows step i + 1: average after steps begin + k, + 2k, ...
                self.averager = PeriodicModelAverager(period=k, warmup_steps=begin + k - 1,
                                                      process_group=group)
        self.averages = 0
        """Model averages so far (interval ends; `synchronize` calls not counted)."""
        self._loss = torch.zeros(2, dtype=torch.float64)

    @property
    def hook(self) -> tuple[Any, PostLocalSGDState]:
        """(hook, state) for `wrap_data_parallel(..., inner=...)`."""
        return post_localSGD_hook, self.hook_state

    @property
    def k(self) -> int:
        """The current averaging interval in steps."""
        return self.averager.k if self.adaptive else self.averager.period

    def observe(self, loss: torch.Tensor, count: Any = None) -> None:
        """A micro-step's loss: a mean (count None) or a sum over `count` items."""
        if not self.adaptive:
            return
        self._loss[0] += loss.detach().to(torch.float64).cpu()
        self._loss[1] += 1.0 if count is None else float(count)

    def after_step(self, step: int, lr: float) -> None:
        """After optimizer step `step` (1-based) taken at learning rate `lr`."""
        self.hook_state.iter = step  # the hook counts backwards; a skipped step has none
        if self.adaptive:
            loss = self._loss[0] / self._loss[1].clamp_min(1.0)
            self._loss.zero_()
            averaged = self.averager.average_parameters(self.params, step, lr, loss)
        else:
            # PeriodicModelAverager's schedule; the averaging itself is called directly, as
            # torch's averager skips parameters without .grad, which the engine freed already.
            a = self.averager
            averaged = a.step >= a.warmup_steps and (a.step - a.warmup_steps) % a.period == 0
            if averaged and self.pairs is not None:
                self.pairs.average(self.params, self.averages)
            elif averaged:
                averaging.average_parameters(iter(self.params), self._group())
            a.step += 1
        self.averages += int(averaged)

    def _group(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD

    def synchronize(self) -> None:
        """Average the workers' weights and optimizer state now (checkpoints, evaluation)."""
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
        averaging.average_parameters(iter([*self.params, *state]), self._group())

    def state_dict(self) -> dict[str, Any]:
        out = {"averager_step": self.averager.step, "averages": self.averages}
        if self.adaptive:
            out["adaptive"] = self.averager.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averager.step = int(state["averager_step"])
        self.hook_state.iter = self.averager.step
        self.averages = int(state["averages"])
        if self.adaptive:
            self.averager.load_state_dict(state["adaptive"])

    def stats(self) -> dict[str, float]:
        return {"local_sgd_k": float(self.k), "local_sgd_averages": float(self.averages)}
