"""The noise scale and the batch doubling from inside someone else's training loop.

A trainer that merges ``k`` micro-batches leaves, after the first micro-batch's
backward, ``w x g_1`` in ``.grad`` (``g_1`` that micro-batch's mean gradient, ``w`` the
weight the trainer's loss normalisation gives it: ``1 / k`` when it divides each loss by
``k``), and before the optimizer step the merged mean gradient ``G`` (all ranks', after
DDP's all-reduce). `NoiseProbe` takes ``|g_1|^2`` at the first point (``first_micro``,
given ``w``) and ``|G|^2`` at the second (``merged``), and folds the pair into a
`bigbatch.GradientNoiseScale` exactly as ``update_from_grads(g_1, G, b, B)`` does, without
keeping a copy of ``g_1``. With several data-parallel ranks each rank's ``|g_1|^2`` is
an estimate at the same batch, so their mean is used (one 2-float all-reduce a step;
every rank then holds the same estimate).

`grow` is the noise-scale doubling rule of ``batch.schedule = "adaptive"``
(`bigbatch.adaptive.batch_growth.NoiseScaleGrowth`) expressed in accumulation steps, for
a trainer whose accumulation can change between epochs.

Needs torch only; the trainer modules (`huggingface`, `lightning`) call it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.adaptive.batch_growth import NoiseScaleGrowth
from bigbatch.adaptive.gns import GradientNoiseScale, NoiseEstimate
from bigbatch.config.scaling import scale_factor
from bigbatch.optim._norms import global_norm

__all__ = ["NoiseProbe", "grow"]


def _sq_norm(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    return global_norm(grads).double().square()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class NoiseProbe:
    """``|g_1|^2`` at the first micro-batch, ``|G|^2`` before the step, into `gns`."""

    def __init__(self, gns: GradientNoiseScale | None = None) -> None:
        self.gns = gns if gns is not None else GradientNoiseScale()
        """The estimator every measured step is folded into (its ``b_simple`` is logged)."""
        self.last: NoiseEstimate | None = None
        """The last step's own estimate (None before one)."""
        self.clipped = 0
        """Steps left out because the trainer had clipped the merged gradient already."""
        self._small: torch.Tensor | None = None
        self._small_batch = 0

    def first_micro(self, params: Iterable[torch.Tensor], batch: int) -> None:
        """After the first micro-batch's backward: ``.grad`` holds a multiple (the weight
        `merged` is given) of the mean gradient of its `batch` examples (this rank's, not
        yet all-reduced). Keeps its squared norm, not the gradient."""
        self._small = _sq_norm(params)
        self._small_batch = int(batch)

    def forget(self) -> None:
        """Drop the kept micro-batch norm (a window that will not be measured)."""
        self._small = None

    def merged(self, params: Iterable[torch.Tensor], merged_batch: int, weight: float,
               clip: float = 0.0) -> NoiseEstimate | None:
        """Before the optimizer step: ``.grad`` holds the mean gradient of `merged_batch`
        examples (all ranks'); `weight`: what the trainer's normalisation multiplied the
        first micro-batch's mean gradient by (``1 / k`` for a loss divided by ``k``).
        Folds the step in and returns its estimate; None when no first micro-batch was
        kept, the merged batch is not larger than it, or (`clip` > 0: the trainer has
        already clipped to that norm) the gradient was clipped, whose norm is lost."""
        small, self._small = self._small, None
        big = _sq_norm(params)
        if small is None or big is None or not 0 < self._small_batch < merged_batch:
            return None
        if clip > 0 and float(big) >= (clip * (1 - 1e-4)) ** 2:
            self.clipped += 1
            return None
        small = small / (weight * weight)
        b = float(self._small_batch)
        world = _world()
        if world > 1:  # the ranks' mean |g_1|^2; b their harmonic mean (equal in practice)
            both = torch.stack([small, torch.full_like(small, 1.0 / b)])
            dist.all_reduce(both)
            small, b = both[0] / world, world / float(both[1])
        self.last = self.gns.update(small, big, round(b), int(merged_batch))
        return self.last

    def stats(self) -> dict[str, float]:
        """What the callbacks log: the tracker's noise scale (the critical-batch estimate,
        in examples), its standard error, and the last step's own estimate."""
        out = {"gns/b_simple": self.gns.b_simple,
               "gns/b_simple_stderr": self.gns.b_simple_stderr}
        if self.last is not None:
            out["gns/step_b_simple"] = self.last.b_simple
        return out


def grow(noise_scale: float, per_accumulation: int, accumulation: int, max_accumulation: int,
         fraction: float = 1.0) -> int | None:
    """The new accumulation count under the noise-scale doubling rule, or None to keep it.

    `per_accumulation`: examples one accumulation step adds to the global batch (micro
    batch x data-parallel ranks). The global batch doubles (once or more) while twice it
    is at most `fraction` x `noise_scale`, never past `max_accumulation` steps.
    """
    rule = NoiseScaleGrowth(fraction)
    new = rule.decide(noise_scale, per_accumulation * accumulation,
                      per_accumulation * max_accumulation)
    return None if new is None else new // per_accumulation


def lr_factor(old_batch: int, new_batch: int, rule: str) -> float:
    """How much the peak LR moves when the global batch goes from `old_batch` to
    `new_batch` under the scaling `rule` ("linear", "sqrt", ...; `bigbatch.scaling`)."""
    return scale_factor(new_batch / old_batch, rule) if new_batch != old_batch else 1.0


def finite(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def loss_of(output: Any) -> torch.Tensor:
    """A training step's loss from what it returned (a tensor, a dict, an object)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output["loss"]
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)):
        loss = output[0]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the training step returned {type(output).__name__}; expected a loss "
                        "tensor, a dict with 'loss', or an output with .loss")
    return loss


def merged_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """For the LR finder over `k` micro-batches: the earlier ones are already backpropagated
    (each divided by `k`); returns the last one over `k`, whose value is the mean of all."""
    k = len(losses)
    earlier = sum(float(x.detach()) for x in losses[:-1])
    return losses[-1] / k + earlier / k


def sweep_at_peak(optimizer: torch.optim.Optimizer, sweep: Any, scheduler: Any = None) -> Any:
    """Run `sweep()` with each group's ``lr`` at the scheduler's base (``initial_lr``,
    which torch's schedulers record), then put the groups' ``lr`` back: a schedule that
    warms up from 0 leaves ``lr`` 0 before the first step, and the range test keeps the
    groups' ratios to the first group's ``lr``. `scheduler`'s state is put back too (a
    `bigbatch.ScheduleLR` counts the sweep's optimizer steps as it counts any)."""
    before = [g["lr"] for g in optimizer.param_groups]
    saved = scheduler.state_dict() if scheduler is not None else None
    for g in optimizer.param_groups:
        g["lr"] = g.get("initial_lr", g["lr"])
    try:
        return sweep()
    finally:
        for g, lr in zip(optimizer.param_groups, before, strict=True):
            g["lr"] = lr
        if saved is not None:
            scheduler.load_state_dict(saved)
