"""bigbatch in Lightning (``lightning.pytorch``): the noise scale and the growing batch as
a callback, and the LR range test on a LightningModule.

    from bigbatch.integrations.lightning import NoiseScaleCallback, lr_find

    trainer = L.Trainer(accumulate_grad_batches=2, callbacks=[NoiseScaleCallback()])

What Lightning leaves in ``.grad`` (automatic optimization): each micro-batch's loss is
divided by ``accumulate_grad_batches`` = ``k`` before its backward, so after the first
micro-batch of a window ``.grad`` is ``g_1 / k`` (this rank's: DDP does not sync until
the window's last backward), and at ``on_before_optimizer_step`` it is the merged mean
gradient of all ranks, unscaled (AMP) and not yet clipped. A window cut short by the
epoch's end is divided by ``k`` all the same, so its gradient is not a mean: left out.

The batch schedule: ``accumulate_grad_batches`` may change between epochs (Lightning's
own ``GradientAccumulationScheduler`` does so), so with ``grow_to`` the callback applies
the noise-scale rule of ``batch.schedule = "adaptive"`` at each epoch's start: the
global batch doubles (accumulation x 2) while twice it is at most
``noise_scale_fraction`` x the measured noise scale, up to ``grow_to`` examples, and the
LR follows ``scaling`` (each scheduler's ``base_lrs`` and each group's ``lr``).
Seesaw (``"seesaw"``, ``"auto"`` for AdamW/LAMB) needs a schedule that counts samples,
which a ``ScheduleLR`` counting optimizer steps is not: use ``bigbatch train`` for it.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch

from bigbatch.adaptive.gns import GradientNoiseScale
from bigbatch.config.schedules import NOISE_SCALE_FRACTIONS
from bigbatch.errors import ConfigError
from bigbatch.integrations.probe import (
    NoiseProbe,
    finite,
    grow,
    loss_of,
    lr_factor,
    merged_loss,
    sweep_at_peak,
)

__all__ = ["NoiseScaleCallback", "lr_find"]

log = logging.getLogger("bigbatch.integrations")


def _rows(batch: Any) -> int:
    """The micro-batch's examples: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return int(batch.shape[0])
    items = list(batch.values()) if isinstance(batch, dict) else \
        list(batch) if isinstance(batch, (list, tuple)) else []
    for item in items:
        try:
            return _rows(item)
        except ConfigError:
            continue
    raise ConfigError(f"NoiseScaleCallback: cannot count the examples of a {type(batch).__name__} "
                      "batch; pass batch_size=...")


class NoiseScaleCallback(pl.Callback):
    """Logs the gradient noise scale (``gns/b_simple``, the critical-batch estimate in
    examples) and, with `grow_to`, grows ``accumulate_grad_batches`` by it.

    Args:
        gns: the estimator (default a new `GradientNoiseScale`).
        grow_to: the global batch (examples) the batch may grow to; None: never grows.
        noise_scale_fraction: the rule's ``f`` (``batch.noise_scale_fraction``); None: as
            bigbatch's default for the optimizer's family, 0.0075 for Adam-type optimizers
            (their ``defaults`` have ``betas``: Adam, AdamW, LAMB) and 1 for the others.
        scaling: how the LR follows a doubling (``batch.scaling``: "linear", "sqrt", ...).
        min_estimates: steps measured before a decision trusts the estimate.
        batch_size: examples per micro-batch per rank; None: read from each batch.

    Needs ``accumulate_grad_batches >= 2`` to measure (two batch sizes a step). The
    values are logged with ``pl_module.log`` every step and kept in `history`; the
    batch changes in `changes`. Its state (estimator, accumulation) is saved in
    Lightning's checkpoints and restored on resume.
    """

    def __init__(self, gns: GradientNoiseScale | None = None, *, grow_to: int | None = None,
                 noise_scale_fraction: float | None = None, scaling: str = "linear",
                 min_estimates: int = 10, batch_size: int | None = None) -> None:
        self.probe = NoiseProbe(gns)
        self.grow_to = grow_to
        self.fraction = None if noise_scale_fraction is None else float(noise_scale_fraction)
        self.scaling = scaling
        self.min_estimates = int(min_estimates)
        self.batch_size = batch_size
        self.history: list[dict[str, float]] = []
        self.changes: list[dict[str, Any]] = []
        self._accumulation: int | None = None  # restored from a checkpoint
        self._position = self._count = self._rows = 0
        self._warned = False

    @property
    def gns(self) -> GradientNoiseScale:
        return self.probe.gns

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ConfigError("NoiseScaleCallback: manual optimization calls backward and "
                              "step itself; feed GradientNoiseScale.update_from_grads there")
        if self.grow_to is not None and "deepspeed" in type(trainer.strategy).__name__.lower():
            raise ConfigError(f"NoiseScaleCallback(grow_to=...): {type(trainer.strategy).__name__}"
                              " cannot change accumulate_grad_batches during a run")

    def _params(self, pl_module: pl.LightningModule) -> list[torch.nn.Parameter]:
        return [p for p in pl_module.parameters() if p.requires_grad]

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._accumulation is not None:  # resumed: the accumulation it had reached
            trainer.accumulate_grad_batches, self._accumulation = self._accumulation, None
        if self.grow_to is None or self.gns.steps < self.min_estimates:
            return
        k, per = trainer.accumulate_grad_batches, self._rows * trainer.world_size
        if not per:
            return
        if self.fraction is None:  # the optimizer exists from fit's start on
            adam = any("betas" in o.defaults for o in trainer.optimizers)
            self.fraction = NOISE_SCALE_FRACTIONS["adamw" if adam else "momentum"]
        new = grow(self.gns.b_simple, per, k, max(k, self.grow_to // per), self.fraction)
        if new is None:
            return
        factor = lr_factor(per * k, per * new, self.scaling)
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
                if "initial_lr" in group:
                    group["initial_lr"] *= factor
        trainer.accumulate_grad_batches = new
        change = {"epoch": trainer.current_epoch, "step": trainer.global_step,
                  "old": per * k, "new": per * new, "accumulate_grad_batches": new,
                  "lr_factor": factor, "noise_scale": self.gns.b_simple}
        self.changes.append(change)
        if trainer.is_global_zero:
            log.info("epoch %d: noise scale %.4g: global batch %d -> %d "
                     "(accumulate_grad_batches %d), LR x %.4g", trainer.current_epoch,
                     self.gns.b_simple, per * k, per * new, new, factor)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._position = batch_idx % trainer.accumulate_grad_batches
        if self._position == 0:
            self._count = 0
            self._rows = self.batch_size or _rows(batch)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._count += 1
        if self._position == 0 and trainer.accumulate_grad_batches >= 2:
            self.probe.first_micro(self._params(pl_module), self._rows)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        k = trainer.accumulate_grad_batches
        if k < 2:
            if not self._warned:
                self._warned = True
                log.warning("NoiseScaleCallback: accumulate_grad_batches=1 gives one batch "
                            "size a step; the noise scale needs >= 2 (nothing is logged)")
            return
        if self._count != k:  # the epoch's short last window
            self.probe.forget()
            return
        est = self.probe.merged(self._params(pl_module), self._rows * k * trainer.world_size,
                                1.0 / k)
        if est is None:
            return
        stats = self.probe.stats()
        self.history.append({"step": trainer.global_step + 1, **stats})
        pl_module.log_dict({n: v for n, v in stats.items() if finite(v)}, on_step=True,
                           on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"gns": self.gns.state_dict(), "changes": list(self.changes),
                "accumulate_grad_batches": self._last_accumulation()}

    def _last_accumulation(self) -> int | None:
        return self.changes[-1]["accumulate_grad_batches"] if self.changes else None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.gns.load_state_dict(state_dict["gns"])
        self.changes = list(state_dict.get("changes", []))
        self._accumulation = state_dict.get("accumulate_grad_batches")


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer from what ``configure_optimizers`` returned (any of its forms)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise ConfigError(f"lr_find: configure_optimizers returned {type(configured).__name__}; "
                      "pass optimizer=...")


def lr_find(module: pl.LightningModule, dataloader: Any, optimizer: Any = None, *,
            accumulate_grad_batches: int = 1, lr_min: float = 1e-5, lr_max: float = 10.0,
            steps: int = 100, **kwargs: Any) -> Any:
    """`bigbatch.lr_find` on a LightningModule outside a Trainer: each step merges
    `accumulate_grad_batches` batches of `dataloader` through ``module.training_step``
    (its ``self.log`` calls do nothing without a Trainer). `optimizer`: a
    ``torch.optim.Optimizer`` or a `bigbatch.Strategy`; None: the first one
    ``configure_optimizers`` returns. Model and optimizer are put back afterwards.
    One process, as Lightning's own ``Tuner.lr_find``."""
    from bigbatch.train.lr_range import lr_find as _lr_find

    if optimizer is None:
        optimizer = _first_optimizer(module.configure_optimizers())
    k = max(1, int(accumulate_grad_batches))

    def windows():
        window: list[Any] = []
        for batch in dataloader:
            window.append(batch)
            if len(window) == k:
                yield window
                window = []

    def loss_fn(model: torch.nn.Module, window: list[Any]) -> torch.Tensor:
        losses = []
        for i, batch in enumerate(window):
            losses.append(loss_of(model.training_step(batch, i)))
            if i < len(window) - 1:
                (losses[-1] / len(window)).backward()
        return merged_loss(losses)

    module.train()

    def sweep() -> Any:
        return _lr_find(module, loss_fn, windows(), optimizer, lr_min=lr_min, lr_max=lr_max,
                        steps=steps, **kwargs)

    if isinstance(optimizer, torch.optim.Optimizer):
        return sweep_at_peak(optimizer, sweep)
    return sweep()
