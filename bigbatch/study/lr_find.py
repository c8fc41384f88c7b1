"""The learning-rate range test at the target global batch (Smith 2017, "Cyclical
Learning Rates"; fastai's `lr_find`).

The usable learning rates narrow as the batch grows (seed 001), so the scaled LR of a
small-batch recipe is a guess. `lr_find` trains for a few hundred steps with the LR
growing exponentially from `lr_min` to `lr_max`, smooths the loss (an exponential
average with bias correction), stops once it diverges (4x its best), and suggests the
LR where the smoothed loss falls fastest against log LR, before divergence. From the
recipe's base batch and LR it says which scaling rule that LR implies:
``lr = base_lr x scale^e`` with e = 1 linear, 0.5 square root. That comparison means
something only when `[batch] base_lr` is the same optimizer's small-batch LR (LAMB's
LR is not AdamW's); at the base batch itself the suggestion is the base LR.

It trains the run's model: rebuild (or reload) the model before the real run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LRFind", "lr_find", "plot_lr_find"]


@dataclass
class LRFind:
    """What `lr_find` measured and suggests."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    suggested_lr: float | None = None
    """The LR of steepest descent of the smoothed loss (None: the loss never fell)."""
    diverged_at: float | None = None
    """The LR at which the smoothed loss passed 4x its best (None: it did not)."""
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
            return "lr-find: the loss did not fall over the swept range; widen --min/--max"
        text = (f"lr-find: suggested peak LR {self.suggested_lr:.3g} at global batch "
                f"{self.global_batch_size}")
        if self.exponent is not None:
            text += (f" = base_lr {self.base_lr:g} x ({self.global_batch_size}/"
                     f"{self.base_batch_size})^{self.exponent:.2f}: closest rule "
                     f"\"{self.rule}\"")
        elif self.global_batch_size == self.base_batch_size:
            text += " (the base batch: set batch.base_lr to it)"
        if self.diverged_at is not None:
            text += f"; diverged at {self.diverged_at:.3g}"
        return text


def lr_find(run: Any, batches: Iterable[Any],
            step: Callable[[Any, Any], float], *, lr_min: float = 1e-5, lr_max: float = 10.0,
            steps: int = 200, smoothing: float = 0.98, diverge: float = 4.0) -> LRFind:
    """The LR range test on a prepared `run` (`bigbatch.prepare`), on your own loop.

    `batches` yields one optimizer step's data each; `step(run, batch)` runs that step's
    micro-steps (``with run.micro_step() as ms: ... ms.backward(...)``) and returns its
    loss as a float. The LR of step i is ``lr_min x (lr_max / lr_min)^(i / (steps - 1))``,
    whatever the run's schedule says. With several workers, each step's loss is the
    workers' mean (return this worker's own) and all stop at the same step.
    """
    if not 0 < lr_min < lr_max:
        raise ValueError(f"lr_find: need 0 < lr_min < lr_max, got {lr_min}, {lr_max}")
    if steps < 2:
        raise ValueError(f"lr_find: steps={steps}; allowed: >= 2")
    plan, b = run.plan, run.strategy.batch
    out = LRFind(global_batch_size=plan.global_batch_size, base_batch_size=b.base_batch_size,
                 base_lr=b.base_lr)
    avg, best, it = 0.0, math.inf, iter(batches)
    for i in range(steps):
        lr = lr_min * (lr_max / lr_min) ** (i / (steps - 1))
        base = run.schedule.lr(run.progress)
        run.lr_scale = lr / base if base > 0 else 0.0
        batch = next(it, _END)
        # Every worker must take the same number of steps (each step's collectives wait
        # for all) and see the same loss, or one stops at a divergence another did not see.
        has_batch, _ = _over_workers(run, batch is not _END, 0.0)
        if not has_batch:
            break
        _, loss = _over_workers(run, True, float(step(run, batch)))
        if not math.isfinite(loss):
            out.diverged_at = lr
            break
        avg = smoothing * avg + (1 - smoothing) * loss
        smooth = avg / (1 - smoothing ** (i + 1))
        out.lrs.append(lr)
        out.losses.append(loss)
        out.smoothed.append(smooth)
        best = min(best, smooth)
        if i > 10 and smooth > diverge * best:
            out.diverged_at = lr
            break
    run.lr_scale = 1.0
    out.suggested_lr = _steepest(out.lrs, out.smoothed)
    scale = plan.global_batch_size / b.base_batch_size
    if out.suggested_lr is not None and scale != 1:
        out.exponent = math.log(out.suggested_lr / b.base_lr) / math.log(scale)
    return out


_END = object()


def _over_workers(run: Any, flag: bool, value: float) -> tuple[bool, float]:
    """(`flag` on every worker, the workers' mean of `value`); as given with one worker."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag, value
    t = torch.tensor([float(flag), value], dtype=torch.float64, device=run.world.device)
    dist.all_reduce(t)
    n = dist.get_world_size()
    return bool(t[0].item() == n), float(t[1].item()) / n


def _steepest(lrs: list[float], smoothed: list[float]) -> float | None:
    """The LR where the smoothed loss falls fastest per unit log LR, up to its minimum."""
    if len(lrs) < 3:
        return None
    stop = smoothed.index(min(smoothed))
    slopes = [(smoothed[i + 1] - smoothed[i - 1]) / math.log(lrs[i + 1] / lrs[i - 1])
              for i in range(1, max(stop, 2))]
    i = min(range(len(slopes)), key=slopes.__getitem__)
    return lrs[i + 1] if slopes[i] < 0 else None


def plot_lr_find(result: LRFind, path: Any) -> None:
    """Loss (raw and smoothed) against LR on a log axis, the suggestion marked; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(result.lrs, result.losses, alpha=0.3, label="loss")
    ax.plot(result.lrs, result.smoothed, label="smoothed")
    if result.suggested_lr is not None:
        ax.axvline(result.suggested_lr, color="C3", ls="--",
                   label=f"suggested {result.suggested_lr:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(f"LR range test at global batch {result.global_batch_size}")
    if result.smoothed:
        lo = min(result.smoothed)
        ax.set_ylim(lo - 0.1 * abs(lo), max(result.smoothed[0] * 1.5, lo + 1e-3))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
