"""`[batch] lr_find = true`: the LR range test a fresh run takes before it trains.

`find_peak_lr` sweeps the LR at the run's global batch, on the run's own workers, from a
copy of the initial weights (a second model and optimizer: the run's model, optimizer
state, sampler and RNG streams are untouched), and returns `FoundLR`: the peak LR the run
trains with, the sweep's curve and how long it took. With no clear descent the run keeps
the scaled base LR and `FoundLR.line()` says so as a warning. The trainer hands the peak
to the run's `ScheduleClock` (`set_peak_lr`), whose state carries it into every
checkpoint, so a resume never sweeps again.

The sweep leaves out what watches or changes a run ([adaptive]: the noise scale, AdaScale,
batch-size policies); merge, AMP, clipping, K-FAC, the optimizer and data parallelism are
the run's.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.config.adaptive_sections import AdaptiveConfig
from bigbatch.engine.prepare import prepare
from bigbatch.tasks.sampler import GlobalBatchSampler
from bigbatch.train import data
from bigbatch.train.lr_range import LRFind, lr_find

__all__ = ["CURVE_FILE", "FoundLR", "endless", "find_peak_lr", "lr_find_phase", "task_step"]

CURVE_FILE = "lr_find.json"
"""The sweep's curve in the run directory (`LRFind.to_dict()` plus the `FoundLR`)."""


@dataclass(frozen=True)
class FoundLR:
    """What the range test decided, as summary.json and the checkpoint record it."""

    peak_lr: float
    """The peak LR the run trains with (the suggestion, or the scaled LR on fallback)."""
    scaled_lr: float
    """The peak the strategy's scaling rule gives (`base_lr x rule(scale)`)."""
    suggested_lr: float | None
    """The sweep's suggestion; None: no clear descent (the run fell back)."""
    reason: str
    """How the suggestion was read, or why there is none."""
    global_batch_size: int
    steps: int
    """Sweep steps taken (it stops at divergence)."""
    time_s: float
    """Wall time of the sweep, its model copy and setup included."""
    curve_file: str = CURVE_FILE

    @property
    def fallback(self) -> bool:
        return self.suggested_lr is None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fallback": self.fallback}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FoundLR:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def line(self) -> str:
        """One line for the log: the LR found, or the warning of the fallback."""
        if self.fallback:
            return (f"warning: lr_find: {self.reason}; training with the scaled LR "
                    f"{self.scaled_lr:.4g} (curve: {self.curve_file})")
        return (f"lr_find: peak LR {self.peak_lr:.4g} at global batch {self.global_batch_size} "
                f"(scaled rule: {self.scaled_lr:.4g}; {self.reason}); {self.steps} steps in "
                f"{self.time_s:.1f} s, curve: {self.curve_file}")


def endless(sampler: Any) -> Any:
    """The sampler's global batches, epoch after epoch (a sweep stops by itself)."""
    while True:
        yield from sampler
        sampler.next_epoch()


def task_step(task: Any, device: torch.device) -> Any:
    """One sweep step of a built-in task: `(run, micro_batches) -> mean loss`, every
    micro-batch through `run.micro_step()` with its summed loss and item count."""

    def one_step(run: Any, micro_batches: list[torch.Tensor]) -> float:
        total = count = 0.0
        for idx in micro_batches:
            batch = data.fetch(task.train_set, idx, device)
            with run.micro_step() as ms:
                loss_sum, n = task.loss(run.model(batch[0]), batch)
                ms.backward(loss_sum, count=n)
            total += float(loss_sum.detach())
            count += float(n)
        return total / max(count, 1.0)

    return one_step


def find_peak_lr(task: Any, model_name: str, initial: dict[str, torch.Tensor], strategy: Any,
                 plan: Any, world: Any, seed: int,
                 steps_per_epoch: int | None) -> tuple[FoundLR, LRFind]:
    """Sweep from a model loaded with `initial` (the run's initial weights) at `plan`'s
    batch on `world`'s workers; every worker returns the same result."""
    t0 = time.perf_counter()
    b = strategy.batch
    model = task.build_model(model_name)
    model.load_state_dict(initial)
    # A flat schedule at one batch (a growing one sweeps at its start): the sweep sets each
    # step's LR itself, as a multiple of the schedule's.
    flat = dataclasses.replace(b, warmup_steps=0, warmup_epochs=0.0, decay="none",
                               schedule="fixed", start_batch_size=None)
    sweep_strategy = dataclasses.replace(strategy, batch=flat, adaptive=AdaptiveConfig())
    # A diverging loss is what the sweep looks for (it stops there itself): no nan_policy.
    run = prepare(model, sweep_strategy, total_steps=strategy.lr_find_steps,
                  steps_per_epoch=steps_per_epoch, world=world, plan=plan, nan_policy=None)
    sampler = GlobalBatchSampler(len(task.train_set), plan.global_batch_size,
                                 plan.micro_batch_size, run.mesh.data_degree,
                                 run.mesh.data_rank, seed)

    one_step = task_step(task, world.device)
    lo, hi = b.lr_find_range
    with torch.random.fork_rng(devices=[world.device] if world.device.type == "cuda" else []):
        result = lr_find(run, endless(sampler), one_step, lr_min=plan.peak_lr * lo,
                         lr_max=plan.peak_lr * hi, steps=strategy.lr_find_steps,
                         safety=b.lr_find_safety)
    del run, model  # the copy's DDP reducer goes before the run's own is used
    gc.collect()
    found = FoundLR(
        peak_lr=result.suggested_lr if result.suggested_lr is not None else plan.peak_lr,
        scaled_lr=plan.peak_lr, suggested_lr=result.suggested_lr, reason=result.reason,
        global_batch_size=plan.global_batch_size,
        steps=len(result.lrs) + (result.diverged_at is not None),
        time_s=time.perf_counter() - t0)
    return found, result


def lr_find_phase(task: Any, model_name: str, initial: dict[str, torch.Tensor], clock: Any,
                  strategy: Any, plan: Any, world: Any, seed: int,
                  steps_per_epoch: int | None) -> tuple[dict[str, Any] | None, str | None]:
    """A fresh run's range test when `batch.lr_find` is on: the found peak set on the run's
    `clock`; returns (`FoundLR.to_dict()`, the curve file's text), or (None, None) when off."""
    if not strategy.batch.lr_find:
        return None, None
    found, curve = find_peak_lr(task, model_name, initial, strategy, plan, world, seed,
                                steps_per_epoch)
    clock.set_peak_lr(found.peak_lr, strategy)
    record = found.to_dict()
    return record, json.dumps({"lr_find": record, **curve.to_dict()}, indent=2) + "\n"
