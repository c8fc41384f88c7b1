"""The learning-rate range test at the target global batch (Smith 2017, "Cyclical
Learning Rates"; fastai's `lr_find`).

The usable learning rates narrow as the batch grows (seed 001), so the scaled LR of a
small-batch recipe is a guess. `lr_find` trains for a few dozen to a few hundred steps
with the LR growing exponentially from `lr_min` to `lr_max`, stops once the loss diverges,
and suggests a peak LR from the curve (`bigbatch.train.lr_suggest`: a centred smoothing
that does not lag on short sweeps, the smoothed minimum over a safety factor, none when
the curve shows no clear descent). From the recipe's base batch and LR it says which
scaling rule that LR implies: ``lr = base_lr x scale^e`` with e = 1 linear, 0.5 square
root. That comparison means something only when `[batch] base_lr` is the same
optimizer's small-batch LR (LAMB's LR is not AdamW's); at the base batch itself the
suggestion is the base LR.

It trains the run's model: rebuild (or reload) the model before the real run
(`[batch] lr_find = true` does that for `bigbatch train`: `bigbatch.train.lr_phase`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.errors import NonFiniteLossError
from bigbatch.optim.lr_scheduler import ScheduleLR
from bigbatch.train.lr_suggest import DIVERGE, SAFETY, diverged, suggest

__all__ = ["LRFind", "lr_find"]


@dataclass
class LRFind:
    """What `lr_find` measured and suggests."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    suggested_lr: float | None = None
    """The smoothed minimum's LR over the safety factor (None: no clear descent)."""
    diverged_at: float | None = None
    """The LR at which the loss diverged (None: it did not)."""
    reason: str = ""
    """One line: how the suggestion was read from the curve, or why there is none."""
    minimum_lr: float | None = None
    """The LR at the smoothed minimum before divergence."""
    global_batch_size: int = 0
    base_batch_size: int = 0
    base_lr: float = 0.0
    exponent: float | None = None
    """e in ``suggested = base_lr x (global / base)^e``: 1 linear, 0.5 square root."""

    @property
    def rule(self) -> str:
        """The scaling rule the suggestion is closest to."""
        if self.exponent is None:
            return "unknown"
        rules = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}
        return min(rules, key=lambda r: abs(rules[r] - self.exponent))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rule": self.rule}

    def summary(self) -> str:
        if self.suggested_lr is None:
            return (f"lr-find: no suggestion: {self.reason}; widen the swept range "
                    "(--min/--max) or sweep longer")
        text = f"lr-find: suggested peak LR {self.suggested_lr:.3g}"
        if self.global_batch_size:
            text += f" at global batch {self.global_batch_size}"
        if self.exponent is not None:
            text += (f" = base_lr {self.base_lr:g} x ({self.global_batch_size}/"
                     f"{self.base_batch_size})^{self.exponent:.2f}: closest rule "
                     f"\"{self.rule}\"")
        elif self.global_batch_size and self.global_batch_size == self.base_batch_size:
            text += " (the base batch: set batch.base_lr to it)"
        return text + f" ({self.reason})"


def lr_find(run: Any, batches: Iterable[Any], step: Callable[..., Any],
            optimizer_or_strategy: Any = None, *, lr_min: float = 1e-5, lr_max: float = 10.0,
            steps: int = 200, smoothing: float | None = None, diverge: float = DIVERGE,
            safety: float = SAFETY, restore: bool = True) -> LRFind:
    """The LR range test on your own loop, with or without `bigbatch.prepare`.

    Two forms, told apart by the first argument:

    - ``lr_find(model, loss_fn, data, optimizer_or_strategy)``: a plain ``nn.Module``
      (DDP/FSDP2/tensor-parallel as you wrapped it), ``loss_fn(model, batch)`` returning
      the loss tensor of one optimizer step's batch, ``data`` yielding those batches, and
      your ``torch.optim.Optimizer`` or a ``bigbatch.Strategy`` (or TOML path) whose
      optimizer is built for it (`bigbatch.build_optimizer`; the strategy also gives the
      base batch and LR the suggestion is compared with). Each step sets every group's
      ``lr`` (a group keeps its ratio to the first group's), then ``zero_grad``,
      ``loss_fn(...).backward()``, ``step``. With `restore` (default) the model's and
      optimizer's state are put back afterwards.
    - ``lr_find(run, batches, step)`` on a prepared `run`: `batches` yields one optimizer
      step's data each; `step(run, batch)` runs that step's micro-steps (``with
      run.micro_step() as ms: ... ms.backward(...)``) and returns its loss as a float.
      It trains the run's model (rebuild or reload it before the real run).

    The LR of step i is ``lr_min x (lr_max / lr_min)^(i / (steps - 1))``, whatever any
    schedule says. With several workers, each step's loss is the workers' mean and all
    stop at the same step. `smoothing`: None, the centred average the suggestion reads; a
    weight in [0, 1), an exponential average with bias correction instead (fastai's,
    0.98: it lags by about 1 / (1 - smoothing) steps) for `smoothed` only. The suggestion
    is the smoothed minimum's LR over `safety` (`bigbatch.train.lr_suggest`).
    """
    if not 0 < lr_min < lr_max:
        raise ValueError(f"lr_find: need 0 < lr_min < lr_max, got {lr_min}, {lr_max}")
    if steps < 2:
        raise ValueError(f"lr_find: steps={steps}; allowed: >= 2")
    if isinstance(run, torch.nn.Module):
        return _plain(run, batches, step, optimizer_or_strategy, restore,
                      dict(lr_min=lr_min, lr_max=lr_max, steps=steps, smoothing=smoothing,
                           diverge=diverge, safety=safety))
    if optimizer_or_strategy is not None:
        raise TypeError("lr_find(run, batches, step): a prepared run has its optimizer; "
                        "optimizer_or_strategy is for lr_find(model, loss_fn, data, ...)")
    plan, b = run.plan, run.strategy.batch
    out = LRFind(global_batch_size=plan.global_batch_size, base_batch_size=b.base_batch_size,
                 base_lr=b.base_lr)

    def set_lr(lr: float) -> None:
        base = run.schedule.lr(run.progress)
        run.lr_scale = lr / base if base > 0 else 0.0

    _sweep(out, set_lr, lambda batch: float(step(run, batch)), batches, run.world.device,
           lr_min, lr_max, steps, smoothing, diverge, safety)
    run.lr_scale = 1.0
    if getattr(run, "nan_guard", None) is not None:  # a check still on the device is over
        with contextlib.suppress(NonFiniteLossError):
            run.nan_guard.check()
    return out


def _plain(model: torch.nn.Module, loss_fn: Callable[..., Any], data: Iterable[Any],
           optimizer_or_strategy: Any, restore: bool, sweep: dict) -> LRFind:
    """`lr_find`'s first form: a model, a loss function and an optimizer or strategy."""
    if isinstance(optimizer_or_strategy, torch.optim.Optimizer):
        optimizer, out = optimizer_or_strategy, LRFind()
    elif optimizer_or_strategy is None:
        raise TypeError("lr_find(model, loss_fn, data, optimizer_or_strategy): give a "
                        "torch.optim.Optimizer or a bigbatch.Strategy")
    else:
        from bigbatch.engine.optimizer import _plan, as_strategy, build_optimizer

        strategy = as_strategy(optimizer_or_strategy)
        optimizer = build_optimizer(model, strategy, lr=sweep["lr_min"])
        plan = _plan(strategy, None)
        out = LRFind(global_batch_size=plan.global_batch_size,
                     base_batch_size=strategy.batch.base_batch_size,
                     base_lr=strategy.batch.base_lr)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())) \
        if restore else None
    first = float(optimizer.param_groups[0]["lr"])
    if not first > 0:
        raise ValueError(f"lr_find: the optimizer's first group has lr={first}; build it at "
                         "any positive lr (the sweep keeps each group's ratio to it)")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    lo, hi, n = sweep["lr_min"], sweep["lr_max"], sweep["steps"]
    # The sweep as a schedule of optimizer steps: every group at its ratio to the first.
    sweeping = ScheduleLR(optimizer, lambda i: lo / first * (hi / lo) ** (i / (n - 1)))

    def one_step(batch: Any) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        sweeping.step()
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    try:
        _sweep(out, lambda lr: None, one_step, data, device, **sweep)
    finally:
        sweeping.remove()
        optimizer.zero_grad(set_to_none=True)
        if saved is not None:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
    return out


def _sweep(out: LRFind, set_lr: Callable[[float], None], one_step: Callable[[Any], float],
           batches: Iterable[Any], device: torch.device, lr_min: float, lr_max: float,
           steps: int, smoothing: float | None, diverge: float, safety: float) -> None:
    """The exponential sweep into `out`, stopping at divergence; then the suggestion."""
    it = iter(batches)
    for i in range(steps):
        lr = lr_min * (lr_max / lr_min) ** (i / (steps - 1))
        set_lr(lr)
        batch = next(it, _END)
        # Every worker must take the same number of steps (each step's collectives wait
        # for all) and see the same loss, or one stops at a divergence another did not see.
        has_batch, _ = _over_workers(device, batch is not _END, 0.0)
        if not has_batch:
            break
        try:
            value = one_step(batch)
        except NonFiniteLossError:  # the run's nan_policy met the divergence first
            value = math.nan
        _, loss = _over_workers(device, True, value)
        out.lrs.append(lr)
        out.losses.append(loss)
        if diverged(out.losses, diverge) is not None:
            out.diverged_at = lr
            break
    found = suggest(out.lrs, out.losses, safety=safety, diverge=diverge)
    out.suggested_lr, out.reason, out.minimum_lr = found.lr, found.reason, found.minimum_lr
    out.smoothed = list(found.smoothed) if smoothing is None else _ema(out.losses, smoothing)
    if out.diverged_at is not None:  # the diverged point itself stays out of the curve
        out.lrs, out.losses = out.lrs[:-1], out.losses[:-1]
        out.smoothed = out.smoothed[:len(out.lrs)]
    if out.suggested_lr is not None and out.base_batch_size and out.base_lr > 0 \
            and out.global_batch_size != out.base_batch_size:
        scale = out.global_batch_size / out.base_batch_size
        out.exponent = math.log(out.suggested_lr / out.base_lr) / math.log(scale)


_END = object()


def _ema(losses: list[float], weight: float) -> list[float]:
    avg, out = 0.0, []
    for i, loss in enumerate(losses):
        avg = weight * avg + (1 - weight) * loss
        out.append(avg / (1 - weight ** (i + 1)))
    return out


def _over_workers(device: torch.device, flag: bool, value: float) -> tuple[bool, float]:
    """(`flag` on every worker, the workers' mean of `value`); as given with one worker."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag, value
    t = torch.tensor([float(flag), value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    n = dist.get_world_size()
    return bool(t[0].item() == n), float(t[1].item()) / n
