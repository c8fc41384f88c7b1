"""The engine: a Strategy applied to your own training loop (Fleet's `distributed_optimizer`).

A plain PyTorch loop::

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

becomes (launch with `torchrun --nproc-per-node N train.py`, or plain `python` for one process)::

    from bigbatch.engine import prepare
    from bigbatch.strategy import Strategy

    model = Net()
    run = prepare(model, Strategy.from_toml("strategy.toml"), total_steps=10_000)
    sampler = DistributedSampler(data, run.world.world_size, run.world.rank)
    loader = DataLoader(data, batch_size=run.plan.micro_batch_size, sampler=sampler)
    for x, y in loader:
        x, y = x.to(run.world.device), y.to(run.world.device)
        with run.micro_step() as ms:                  # autocast; no_sync but on the k-th
            loss = F.cross_entropy(run.model(x), y)
            ms.backward(loss)                         # merge, loss scaling, step, LR
    run.close()

For a summed loss over a variable number of items (tokens), pass the count and
the merged step is exactly one step on the big batch::

            loss = F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100)
            ms.backward(loss, count=(targets != -100).sum())

Gradient semantics per optimizer step (k micro-steps, W workers):
- `ms.backward(loss)` with a per-micro-batch *mean* loss: the optimizer sees the
  mean over workers of the mean of the k micro-step gradients (`gradient_merge.avg
  = true`) or of their sum (`avg = false`, Fleet's semantics).
- `ms.backward(loss, count=n)` with a *summed* loss: the optimizer sees the sum
  over all micro-steps and workers divided by the total count (one scalar
  all-reduce per step); `avg = false` multiplies that by k, as for mean losses.

BatchNorm under gradient merge normalises each micro-batch on its own and its
running statistics advance once per micro-step; SyncBatchNorm
(`data_parallel.sync_batch_norm`) synchronises over workers but never over
micro-steps. Use a model without BatchNorm where exact big-batch equivalence matters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch._amp import LossScaler, amp_dtype
from bigbatch._engine_setup import (
    CommState,
    apply_recompute,
    build_optimizer,
    check_reduce,
    wrap_data_parallel,
)
from bigbatch._grad_info import GradInfo, small_batch_sq_norm, sq_norm
from bigbatch.distributed import World, all_reduce_sum, init_distributed, teardown
from bigbatch.errors import ConfigError

__all__ = ["GradInfo", "MicroStep", "Run", "prepare"]


class MicroStep:
    """One micro-step: enter around forward and backward, call `backward` once."""

    __slots__ = ("_run", "_contexts", "is_last", "stepped", "skipped", "_called")

    def __init__(self, run: Run) -> None:
        self._run = run
        self._contexts: list[Any] = []
        self.is_last = False
        """True on the k-th micro-step, the one that all-reduces and steps."""
        self.stepped = False
        """After the block: the optimizer stepped (False while merging, and on overflow)."""
        self.skipped = False
        """After the block: the step was skipped for inf/nan gradients (fp16)."""
        self._called = False

    def __enter__(self) -> MicroStep:
        run = self._run
        self.is_last = run.micro == run.k_steps - 1
        if run._ddp is not None and not self.is_last:
            self._contexts.append(run._ddp.no_sync())
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
                run._count_work = all_reduce_sum(run._count_tensor, async_op=True)
        if mult != 1.0:
            loss = loss * mult
        if run.scaler is not None:
            loss = run.scaler.scale(loss)
        if run.autocast_dtype is not None:
            with torch.autocast(run.world.device.type, enabled=False):
                loss.backward()
        else:
            loss.backward()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        for ctx in reversed(self._contexts):
            ctx.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return False
        if not self._called:
            raise RuntimeError("call ms.backward(loss) inside `with run.micro_step() as ms:`")
        run = self._run
        if self.is_last:
            self.skipped = run._finish_step()
            self.stepped = not self.skipped
        else:
            if run.micro == 0 and run._measure_first:
                run._first_sq = sq_norm([p.grad for p in run._params if p.grad is not None])
                run._first_count = run._count
            run.micro += 1
        return False


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
                 measure_first: bool = False) -> None:
        self.module = module
        """The user's model (unwrapped): save and load its state_dict."""
        self.model = model
        """What to call in forward: DDP(module) with several workers, else module."""
        self.optimizer = optimizer
        self.schedule = schedule
        """`Schedule`: `schedule.lr(step)` is the LR of optimizer step `step`."""
        self.world = world
        self.plan = plan
        """The resolved BatchPlan (global/micro batch, k_steps, peak_lr)."""
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
        self.lr_scale = 1.0
        """Extra LR multiplier on top of the schedule (adaptive methods)."""
        self.grad_hooks: list[Callable[[GradInfo], None]] = []
        """Called at each taken step with a GradInfo, after unscale, before the optimizer."""
        self.state_objects: dict[str, Any] = {}
        """Extra stateful helpers (GNS tracker, ...) saved in `state_dict()` under their name."""
        self.track_grad_norm = track_stats
        """Record the global grad norm at every step for `stats` (one foreach norm)."""
        self.last_lr = schedule.lr(0)
        self._ddp = model if model is not module else None
        self._comm = comm
        self._owns_group = owns_group
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._measure_first = measure_first and self.k_steps > 1
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
        return 1.0 / self.k_steps if self.avg else 1.0

    @property
    def _count_mult(self) -> float:
        # Summed losses are scaled by a constant before backward so fp16 gradients keep
        # mean-loss magnitudes; the exact 1/total_count is applied at the step.
        return 1.0 / self.plan.micro_batch_size

    def lr_at(self, progress: float) -> float:
        """Learning rate the optimizer gets at schedule position `progress`."""
        return self.schedule.lr(progress) * self.lr_scale

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _reset_window(self) -> None:
        self.micro = 0
        self._mode: str | None = None
        self._count = 0.0
        self._count_tensor: torch.Tensor | None = None
        self._count_work: Any = None
        self._first_sq: torch.Tensor | None = None
        self._first_count = 0.0

    def _finish_step(self) -> bool:
        """All micro-steps done and gradients reduced: normalise, unscale, step. True if skipped."""
        W = self.world.world_size
        local_count = self._count
        total_count = local_count
        if self._mode == "count":
            if self._count_work is not None:
                self._count_work.wait()
            if self._count_tensor is not None:
                total_count = self._count_tensor
            if not isinstance(total_count, torch.Tensor) and total_count <= 0:
                raise ValueError("ms.backward(count=...): the total count over the optimizer step is 0")
            # A tensor factor keeps this free of host syncs (a zero total gives inf/nan grads).
            factor = W / (self._count_mult * total_count)
            if not self.avg:
                factor *= self.k_steps
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
        found_inf = self.scaler.unscale_(self.optimizer) if self.scaler is not None else False
        local_raw = self._comm.take_local_sq() if self._comm is not None else None
        if not found_inf:
            if self.grad_hooks:
                self._run_hooks(local_raw, local_count, total_count)
            if self.track_grad_norm:
                self._grad_norm = sq_norm([p.grad for p in self._params if p.grad is not None]).sqrt()
            self.last_lr = self.lr_at(self.progress)
            self._set_lr(self.last_lr)
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()
        if found_inf:
            self.skipped_steps += 1
        else:
            self.step += 1
            self.progress += self.progress_rate
        return found_inf

    def _run_hooks(self, local_raw: torch.Tensor | None, local_count: float,
                   total_count: float) -> None:
        local_sq, local_batch, global_batch = small_batch_sq_norm(self, local_raw, local_count,
                                                                  total_count)
        info = GradInfo(self, self._params, local_sq, local_batch, global_batch)
        for hook in self.grad_hooks:
            hook(info)

    # ------------------------------------------------------------- reporting

    @property
    def stats(self) -> dict[str, float]:
        """Numbers for logging, read on access (a device sync on GPU for norms)."""
        out: dict[str, float] = {
            "step": float(self.step),
            "lr": float(self.last_lr),
            "skipped_steps": float(self.skipped_steps),
            "loss_scale": self.scaler.scale_value if self.scaler is not None else 1.0,
        }
        if self._grad_norm is not None:
            out["grad_norm"] = float(self._grad_norm)
        ratios_of = getattr(self.optimizer, "trust_ratios", None)
        ratios = ratios_of() if callable(ratios_of) else None
        if ratios is not None and ratios.numel():
            r = ratios.detach().float()
            out["trust_ratio_min"] = float(r.min())
            out["trust_ratio_median"] = float(r.median())
            out["trust_ratio_max"] = float(r.max())
        return out

    # ------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, loss scaler, counters, schedule position and registered helpers.

        Taken mid-merge-window it also holds this worker's accumulated gradients
        (per rank under DDP); at a step boundary (`ms.stepped`) it holds none.
        """
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step,
            "micro": self.micro,
            "skipped_steps": self.skipped_steps,
            "progress": self.progress,
            "progress_rate": self.progress_rate,
            "lr_scale": self.lr_scale,
            "k_steps": self.k_steps,
            "extra": {name: obj.state_dict() for name, obj in self.state_objects.items()},
        }
        if self.micro:
            state["window"] = {
                "mode": self._mode,
                "count": self._count,
                "grads": [None if p.grad is None else p.grad.detach().clone() for p in self._params],
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (the model's weights are loaded separately)."""
        if int(state["k_steps"]) != self.k_steps and state["micro"]:
            raise ConfigError(
                f"checkpoint taken mid-merge-window with k_steps={state['k_steps']}, "
                f"this run has k_steps={self.k_steps}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.progress = float(state["progress"])
        self.progress_rate = float(state["progress_rate"])
        self.lr_scale = float(state["lr_scale"])
        for name, sub in state.get("extra", {}).items():
            if name in self.state_objects:
                self.state_objects[name].load_state_dict(sub)
        self._reset_window()
        window = state.get("window")
        if window is not None:
            self.micro = int(state["micro"])
            self._mode = window["mode"]
            self._count = float(window["count"])
            for p, g in zip(self._params, window["grads"], strict=True):
                p.grad = None if g is None else g.to(p.device).clone()
        self.last_lr = self.lr_at(self.progress)
        self._set_lr(self.last_lr)

    def close(self) -> None:
        """Tear down the process group if `prepare()` created it."""
        if self._owns_group:
            teardown()
            self._owns_group = False


def prepare(model: nn.Module, strategy: Any, total_steps: int, steps_per_epoch: int | None = None,
            world: World | None = None, *, track_stats: bool = False,
            local_grad_norm: bool | None = None) -> Run:
    """Apply `strategy` to `model` and return the `Run` that drives the training loop.

    `total_steps` and `steps_per_epoch` count optimizer steps (one per global
    batch); `steps_per_epoch` is needed only for `batch.warmup_epochs`. `world`
    defaults to `World.from_env()`; with more than one worker the process group
    is created from `data_parallel` unless one exists. `track_stats` records the
    grad norm and trust ratios for `run.stats`. `local_grad_norm` measures each
    worker's pre-all-reduce gradient norm for grad hooks (scalars only; default:
    on when `adaptive.noise_scale` or AdaScale is enabled).
    """
    from bigbatch.schedules import Schedule

    world = world if world is not None else World.from_env()
    plan = strategy.resolve(world.world_size)
    schedule = Schedule.from_strategy(strategy, plan, total_steps, steps_per_epoch)
    dp = strategy.data_parallel
    check_reduce(getattr(dp, "reduce", "mean"))
    amp = strategy.amp
    autocast_dtype = amp_dtype(amp.dtype) if amp.enable else None
    if dp.sync_batch_norm and world.is_distributed:
        if world.device.type != "cuda":
            raise ConfigError(
                f"data_parallel.sync_batch_norm=true needs CUDA devices (torch's SyncBatchNorm "
                f"is GPU-only); this worker runs on {world.device.type}"
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    checkpoints = list(strategy.recompute.checkpoints) if strategy.recompute.enable else []
    if checkpoints:
        apply_recompute(model, checkpoints)  # validates names before any group exists
    adaptive = getattr(strategy, "adaptive", None)
    if local_grad_norm is None:
        local_grad_norm = bool(adaptive is not None and (
            getattr(adaptive, "noise_scale", False) or getattr(adaptive, "lr", "none") == "adascale"))

    owns_group = world.is_distributed and not dist.is_initialized()
    init_distributed(dp, world)
    model.to(world.device)
    optimizer = build_optimizer(model, strategy, lr=schedule.lr(0))
    wrapped, comm = model, None
    if world.is_distributed:
        wrapped, comm = wrap_data_parallel(model, world.device, dp, bool(local_grad_norm))
    scaler = None
    if autocast_dtype == torch.float16:
        scaler = LossScaler.from_config(amp, world.device.type)
    return Run(module=model, model=wrapped, optimizer=optimizer, schedule=schedule, world=world,
               plan=plan, strategy=strategy, scaler=scaler, autocast_dtype=autocast_dtype,
               avg=strategy.gradient_merge.avg, comm=comm, owns_group=owns_group,
               track_stats=track_stats,
               measure_first=bool(local_grad_norm) and not world.is_distributed)
