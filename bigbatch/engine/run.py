"""`Run`: a Strategy applied to your own training loop (Fleet's `distributed_optimizer`);
`bigbatch.engine.prepare` builds it. The package docstring (`bigbatch.engine`) is the guide."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bigbatch.config.parallelism import degrees
from bigbatch.config.schedules import warmup_start_lr
from bigbatch.engine import adaptive as _adaptive
from bigbatch.engine import state as _run_state
from bigbatch.engine.amp import LossScaler
from bigbatch.engine.grad_info import GradInfo, grad_info, sq_norm
from bigbatch.engine.micro_step import MicroStep
from bigbatch.errors import ConfigError
from bigbatch.optim._norms import local
from bigbatch.parallel.data_parallel import CommState
from bigbatch.parallel.mesh import ParallelMesh
from bigbatch.parallel.world import World, all_reduce_sum, teardown

__all__ = ["GradInfo", "MicroStep", "Run", "schedule_steps"]

schedule_steps = _adaptive.schedule_steps


class Run:
    """A prepared training run: model, optimizer, schedule and the per-step logic.

    Build with `prepare()`. Attributes are public and plain; `state_dict()`
    holds everything needed to resume exactly (the model's own weights are
    `run.module.state_dict()`).
    """

    def __init__(self, *, module: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
                 schedule: Any, world: World, plan: Any, strategy: Any,
                 scaler: LossScaler | None, autocast_dtype: torch.dtype | None, avg: bool,
                 comm: CommState | None, owns_group: bool, track_stats: bool,
                 measure_first: bool = False, total_steps: int | None = None,
                 unit_batch_size: int | None = None, mesh: ParallelMesh | None = None,
                 loss_parallel: bool = False, pipeline: Any = None) -> None:
        self.module = module
        """The user's model (unwrapped): save and load its state_dict."""
        self.model = model
        """What to call in forward: DDP(module) with several workers, else module."""
        self.optimizer = optimizer
        self.schedule = schedule
        """`Schedule`: `schedule.lr(step)` is the LR of optimizer step `step`."""
        self.world = world
        self.mesh = mesh if mesh is not None else ParallelMesh(degrees(strategy, world.world_size),
                                                               world)
        """`ParallelMesh`: data, sharding and tensor-parallel degrees, this rank's place, groups."""
        self.plan = plan
        """The BatchPlan in force (global/micro batch, k_steps, peak_lr); goodput replaces it."""
        self.strategy = strategy
        self.scaler = scaler
        """fp16 loss scaler, None for bf16 or fp32."""
        self.autocast_dtype = autocast_dtype
        self.k_steps = int(plan.k_steps)
        """Micro-steps per optimizer step (gradient merge)."""
        self.avg = bool(avg)
        self.step = 0
        """Optimizer steps taken (skipped overflow steps excluded)."""
        self.micro = 0
        """Position inside the current merge window, 0 <= micro < k_steps."""
        self.skipped_steps = 0
        """Optimizer steps skipped because of inf/nan gradients."""
        self.progress = 0.0
        """Where the schedule is read: advances by `progress_rate` per step taken."""
        self.progress_rate = 1.0
        """Schedule progress per step (AdaScale sets its gain here; 1 = plain steps)."""
        self.total_steps = int(total_steps if total_steps is not None else schedule.total_steps)
        """Training length in schedule units: `done` once `progress` reaches it."""
        self.unit_batch_size = int(unit_batch_size or plan.global_batch_size)
        """Samples of one schedule unit: the first run's global batch (AdaScale: the base
        batch). A step of another global batch advances `progress` by global / unit."""
        self.lr_scale = 1.0
        """Extra LR multiplier on top of the schedule (adaptive methods)."""
        self.grad_hooks: list[Callable[[GradInfo], None]] = []
        """Called at each taken step with a GradInfo, after unscale, before the optimizer."""
        self.step_hooks: list[Callable[[Run], None]] = []
        """Called after each taken optimizer step, between steps (batch-size changes go here)."""
        self.state_objects: dict[str, Any] = {}
        """Extra stateful helpers saved in `state_dict()` under their name; those with a
        `stats()` method add to `run.stats`."""
        self.adaptive: Any = None
        """The `[adaptive]` controller (`bigbatch.engine.adaptive.Adaptive`), None when off."""
        self.local_sgd: Any = None
        """`bigbatch.parallel.local_sgd.LocalSGD` of `[localsgd]`/`[adaptive_localsgd]` runs on
        several workers, else None."""
        self.batch_size_changes: list[dict[str, Any]] = []
        """Policy decisions that changed the batch: step, old, new, micro, k, reason."""
        self.policies: Any = None
        """`bigbatch.engine.policies.Policies`: the run's policies and the loop's hooks."""
        self.micro_batch_sizes: list[int] | None = None
        """Per data rank micro batches when they differ (straggler rebalancing), summing to
        ``plan.micro_batch_size x data degree``; None: all ``plan.micro_batch_size``. The
        loader must follow it; mean losses are weighted by samples, so the step stays the
        big-batch step. `set_batch` resets it."""
        self.timing: Any = None
        """A step timer told when each backward ends (`bigbatch.engine.step_timing`), or None."""
        self.last_step_seconds = 0.0
        """Seconds inside the micro-step blocks of the latest optimizer step (no data loading)."""
        self.sync_timing = False
        """Synchronise the device at each micro-step's end so step times are device times."""
        self.track_grad_norm = track_stats
        """Record the global grad norm at every step for `stats` (one foreach norm)."""
        self.max_grad_norm = strategy.max_grad_norm() if hasattr(strategy, "max_grad_norm") \
            else None
        """Clip the global gradient norm to this before the optimizer (None: no clipping);
        `stats["grad_norm"]` is the norm before clipping."""
        self.last_lr = schedule.lr(0)
        self._base_schedule = schedule
        self._ddp = model if model is not module else None
        # FSDP2 shards the module in place: the module itself controls gradient sync.
        self._fsdp = module if self.mesh.degrees.uses_mesh and self.mesh.data_degree > 1 else None
        self._loss_parallel = loss_parallel
        self.pipeline = pipeline
        """`PipelineRunner` of `[pipeline]` runs (drive them with `pipeline_step`), else None."""
        self.pipeline_norms: Any = None
        """A pipeline's noise-scale norms (`bigbatch.engine.pipeline_gns`), None elsewhere."""
        if pipeline is not None:
            self._fsdp = None  # torch's pipeline stages switch FSDP2's gradient sync
        self._comm = comm
        self._owns_group = owns_group
        self._params = [p for p in module.parameters() if p.requires_grad]
        # Not tied to k_steps > 1 here: an adaptive batch size may turn merging on later.
        self._measure_first = measure_first
        self._first_sq_norm: Callable[[list[torch.Tensor]], torch.Tensor] = (
            lambda params: sq_norm([p.grad for p in params if p.grad is not None]))
        self._step_time = 0.0
        self._grad_norm: torch.Tensor | None = None
        self._reset_window()
        if track_stats and hasattr(optimizer, "track_trust_ratios"):
            optimizer.track_trust_ratios = True
        self._set_lr(self.last_lr)

    # ------------------------------------------------------------- stepping

    def micro_step(self) -> MicroStep:
        """Context for one micro-step's forward and backward (see the module example)."""
        return MicroStep(self)

    # Read per micro-step rather than cached so that changing `k_steps` or `plan`
    # between optimizer steps (adaptive batch size) takes effect at once.
    @property
    def _mean_mult(self) -> float:
        mult = 1.0 / self.k_steps if self.avg else 1.0
        if self.micro_batch_sizes is not None:  # the workers' mean, weighted by samples
            mult *= self.micro_batch_sizes[self.mesh.data_rank] / self.plan.micro_batch_size
        return mult

    @property
    def _count_mult(self) -> float:
        # Summed losses are scaled by a constant before backward so fp16 gradients keep
        # mean-loss magnitudes; the exact 1/total_count is applied at the step.
        return 1.0 / self.plan.micro_batch_size

    def pipeline_step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                      loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step of a `[pipeline]` run: all `k_steps` micro-batches through the
        pipeline, then the step. Every rank calls it; `inputs` (this data rank's
        ``micro x k_steps`` samples) matter on the first stage, `targets` on the last.

        `loss(output, target) -> (sum over items, item count)`: the step divides the
        gradient by the global item count, as `ms.backward(sum, count=...)` does. Returns
        this rank's (loss sum, count); zeros except on the last stage's first tensor rank.
        """
        t0 = time.perf_counter()
        scale = self.scaler.scale if self.scaler is not None else None
        if self.pipeline.asynchronous:  # PipeDream: the stages step per micro-batch
            self.last_lr = self.lr_at(self.progress)
            self._set_lr(self.last_lr)
            total, count = self.pipeline.step(inputs, targets, loss, self._count_mult)
            self._add_step_time(t0)
            self.last_step_seconds, self._step_time = self._step_time, 0.0
            self.step += 1
            self.progress += self.progress_rate
            for hook in self.step_hooks:
                hook(self)
            return total, count
        if self.scaler is not None:
            # Stages before the last never scale a loss themselves, yet unscale the
            # (scaled) gradients they receive: GradScaler must have its scale ready.
            self.scaler.scale(torch.ones((), device=self.world.device))
        with self.autocast():
            total, count = self.pipeline.step(inputs, targets, loss, self._count_mult, scale)
        # The global item count: the reporting ranks' counts (one per data rank), summed.
        self._mode = "count"
        self._count = float(count)
        self._count_tensor = count.to(self.world.device, copy=True)
        all_reduce_sum(self._count_tensor)
        self._finish_step(t0)
        return total, count

    def autocast(self) -> Any:
        """The strategy's autocast context (a no-op without `[amp]`): for evaluation and any
        forward outside `micro_step()`, so it runs in the precision training used."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.world.device.type, dtype=self.autocast_dtype)

    def loss_parallel(self) -> Any:
        """Context for a loss computed outside `micro_step()` (evaluation): torch's
        `loss_parallel()` when tensor parallelism keeps the logits sharded on the
        vocabulary, else a no-op."""
        from bigbatch.parallel.tensor_parallel import loss_parallel_if

        return loss_parallel_if(self._loss_parallel)

    def lr_at(self, progress: float) -> float:
        """Learning rate the optimizer gets at schedule position `progress`."""
        return self.schedule.lr(progress) * self.lr_scale

    @property
    def done(self) -> bool:
        """Whether the schedule's length is reached (`progress >= total_steps`)."""
        return self.progress >= self.total_steps

    def _add_step_time(self, t0: float) -> None:
        if self.sync_timing and self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        self._step_time += time.perf_counter() - t0

    def _set_lr(self, lr: float) -> None:
        # A group's own "lr_scale" (e.g. in a user's optimizer) multiplies the schedule's LR.
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def set_batch(self, micro_batch_size: int, k_steps: int) -> None:
        """Use ``global = micro x k_steps x world_size`` from the next optimizer step on.

        The peak LR follows `batch.scaling` for the new global batch, and progress
        advances by ``global / unit_batch_size`` per step, so the run's length stays
        in samples. Call between optimizer steps; the loader must follow `run.plan`.
        """
        if self.micro:
            raise RuntimeError("run.set_batch() inside a merge window; call it after the "
                               "optimizer step (ms.stepped)")
        if self.pipeline is not None and (micro_batch_size, k_steps) != (
                self.plan.micro_batch_size, self.k_steps):
            raise ConfigError(
                f"run.set_batch({micro_batch_size}, {k_steps}) under [pipeline]: the schedule "
                f"runs {self.k_steps} micro-batches of {self.plan.micro_batch_size} "
                f"(pipeline.accumulate_steps, micro_batch_size), fixed for the run")
        W = self.mesh.data_degree
        self.plan = plan = self.strategy.batch_plan(micro_batch_size * k_steps * W,
                                                    micro_batch_size, k_steps, W)
        self.k_steps = plan.k_steps
        self.micro_batch_sizes = None
        self.schedule = dataclasses.replace(
            self._base_schedule, peak_lr=plan.peak_lr,
            warmup_start_lr=warmup_start_lr(self.strategy.batch.base_lr, plan.peak_lr,
                                            self.strategy.batch.warmup_start,
                                            self._base_schedule.warmup_steps))
        # AdaScale replaces the rate by its gain at every step.
        self.progress_rate = plan.global_batch_size / self.unit_batch_size
        if self.adaptive is not None:
            self.adaptive.on_batch_change()

    def apply_gradients(self, grads: list[torch.Tensor | None]) -> None:
        """One optimizer step on gradients computed elsewhere (a parameter server's combined
        gradient), one per trainable parameter, already in the optimizer's units: the step
        that ends a merge window (schedule LR, statistics, step hooks), without backward."""
        if self.micro:
            raise RuntimeError("run.apply_gradients() inside a merge window")
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g
        self._finish_step(time.perf_counter())

    def synchronize(self) -> None:
        """Local SGD: average the workers' weights and optimizer state now (before evaluating
        or saving; `state_dict()` does it itself). Every worker calls it; else a no-op."""
        if self.local_sgd is not None:
            self.local_sgd.synchronize()

    def skip_step(self) -> None:
        """Drop the merge window's gradients: no optimizer step, the schedule stays.

        For a step that must not count (a non-finite loss): call it instead of
        `ms.backward()` inside the micro-step's block (`ms.skip()`) or between
        micro-steps. With several workers every worker must skip the same step.
        """
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()
        self._step_time = 0.0

    def _reset_window(self) -> None:
        self.micro = 0
        self._mode: str | None = None
        self._count = 0.0
        self._count_tensor: torch.Tensor | None = None
        self._count_work: Any = None
        self._first_sq: torch.Tensor | None = None
        self._first_count = 0.0

    def _finish_step(self, t0: float) -> bool:
        """All micro-steps done and gradients reduced: normalise, unscale, step. True if skipped.

        `t0`: when the last micro-step's block was entered (step timing).
        """
        local_count = self._count
        total_count = local_count
        if self._mode == "count":
            total_count = self._total_count()
            grads = [local(p.grad) for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.grad_factor())
        found_inf = self.scaler.unscale_(self.optimizer) if self.scaler is not None else False
        local_raw = self._comm.take_local_sq() if self._comm is not None else None
        if not found_inf:
            info = self._run_hooks(local_raw, local_count, total_count) if self.grad_hooks else None
            if self.track_grad_norm or self.max_grad_norm is not None:
                if self.pipeline is not None:  # each stage holds part of the model
                    global_sq = self.pipeline.grad_sq_norm()
                elif info is not None:
                    global_sq = info.global_sq_norm()
                else:
                    global_sq = sq_norm([p.grad for p in self._params if p.grad is not None])
                self._grad_norm = global_sq.sqrt()
            if self.max_grad_norm is not None:
                self._clip(self._grad_norm)
            self.last_lr = self.lr_at(self.progress)
            self._set_lr(self.last_lr)
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()
        self._add_step_time(t0)
        self.last_step_seconds, self._step_time = self._step_time, 0.0
        if found_inf:
            self.skipped_steps += 1
        else:
            self.step += 1
            self.progress += self.progress_rate
            for hook in self.step_hooks:
                hook(self)
        return found_inf

    def _clip(self, norm: torch.Tensor) -> None:
        """Scale the gradients by ``max_norm / max(norm, max_norm)`` (clip the global norm;
        NVIDIA's LAMB pre-normalisation is the same), as a tensor: no host sync."""
        grads = [local(p.grad) for p in self._params if p.grad is not None]
        if grads:
            limit = torch.as_tensor(self.max_grad_norm, dtype=norm.dtype, device=norm.device)
            torch._foreach_mul_(grads, (limit / torch.maximum(norm, limit)).to(grads[0].dtype))

    def _total_count(self) -> float | torch.Tensor:
        """The step's item count over all workers (waits for its all-reduce)."""
        if self._count_work is not None:
            self._count_work.wait()
            self._count_work = None
        total = self._count_tensor if self._count_tensor is not None else self._count
        if not isinstance(total, torch.Tensor) and total <= 0:
            raise ValueError("ms.backward(count=...): the total count over the optimizer step is 0")
        return total

    def grad_factor(self) -> float | torch.Tensor:
        """What the step multiplies the reduced gradients by: with `count=` losses the count
        normalisation (1 for mean losses). A stateful reduce (DGC) reads it during the last
        backward to accumulate in the optimizer's units."""
        if self._mode != "count":
            return 1.0
        # A tensor factor keeps this free of host syncs (a zero total gives inf/nan grads).
        factor = self.mesh.data_degree / (self._count_mult * self._total_count())
        return factor if self.avg else factor * self.k_steps

    def _run_hooks(self, local_raw: torch.Tensor | None, local_count: float,
                   total_count: float) -> GradInfo:
        info = grad_info(self, local_raw, local_count, total_count)
        for hook in self.grad_hooks:
            hook(info)
        return info

    # ------------------------------------------------------------- reporting, resume

    @property
    def stats(self) -> dict[str, float]:
        """Numbers for logging, read on access (a device sync on GPU for norms): step, lr,
        skipped steps, loss scale, grad norm, trust ratios and the helpers' `stats()`."""
        return _run_state.stats(self)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, loss scaler, counters, schedule position, batch and registered helpers.

        Call it on every rank: with ZeRO stage 1 it gathers the optimizer state to rank 0
        (the others get None there); with FSDP2 or tensor parallelism the optimizer's
        state is left to DCP (`bigbatch.train.sharded`) and is None here.
        Taken mid-merge-window it also holds this worker's accumulated gradients
        (per rank under DDP); at a step boundary (`ms.stepped`) it holds none.
        """
        return _run_state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (the model's weights are loaded separately).

        On another world size (or a changed batch configuration) the batch follows
        `bigbatch.config.elastic.resume_plan` and the schedule keeps the checkpoint's unit;
        registered helpers (noise scale, AdaScale, goodput) load first and carry over.
        """
        _run_state.load_state_dict(self, state)

    def close(self) -> None:
        """Tear down the process group if `prepare()` created it."""
        if self._owns_group:
            # DDP's reducer must go before the process group it uses (see `train.train`).
            self.model, self._ddp = self.module, None
            if self.pipeline is not None:
                self.pipeline.close()
            gc.collect()
            teardown()
            self._owns_group = False
