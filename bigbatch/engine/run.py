"""`Run`: a Strategy applied to your own training loop (Fleet's `distributed_optimizer`);
`bigbatch.engine.prepare` builds it. The package docstring (`bigbatch.engine`) is the guide,
and its end tours the parts (`clock`, `window`, `batch`) that each own a piece of the state:
`Run` wires them, and `_finish_step` runs the step's stages (`bigbatch.engine.step`)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bigbatch.config.parallelism import degrees
from bigbatch.engine import adaptive as _adaptive
from bigbatch.engine import saving as _saving
from bigbatch.engine import state as _run_state
from bigbatch.engine import step as _step
from bigbatch.engine.amp import LossScaler
from bigbatch.engine.amp_lists import amp_context
from bigbatch.engine.batch import BatchControl
from bigbatch.engine.clock import ScheduleClock
from bigbatch.engine.data_share import check_same_inputs, data_loader, data_sampler
from bigbatch.engine.grad_info import GradInfo, grad_info
from bigbatch.engine.merge import MergeWindow
from bigbatch.engine.micro_step import MicroStep
from bigbatch.engine.nonfinite import LossGuard
from bigbatch.errors import NonFiniteLossError
from bigbatch.parallel.data_parallel import CommState
from bigbatch.parallel.mesh import ParallelMesh
from bigbatch.parallel.world import World, all_reduce_sum, teardown

__all__ = ["GradInfo", "MicroStep", "Run", "schedule_steps"]

schedule_steps = _adaptive.schedule_steps


def _delegate(part: str, name: str, doc: str, settable: bool = False) -> property:
    """A `Run` attribute that is one of its parts' (read-only unless `settable`)."""

    def get(self: Run) -> Any:
        return getattr(getattr(self, part), name)

    def put(self: Run, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put if settable else None, doc=doc)


class Run:
    """A prepared training run: model, optimizer, schedule and the per-step logic.

    Build with `prepare()`. `state_dict()` holds everything needed to resume
    exactly (the model's own weights are `run.module.state_dict()`).
    """

    def __init__(self, *, module: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
                 schedule: Any, world: World, plan: Any, strategy: Any,
                 scaler: LossScaler | None, autocast_dtype: torch.dtype | None, avg: bool,
                 comm: CommState | None, owns_group: bool, track_stats: bool,
                 measure_first: bool = False, total_steps: int | None = None,
                 unit_batch_size: int | None = None, mesh: ParallelMesh | None = None,
                 loss_parallel: bool = False, pipeline: Any = None,
                 nan_policy: str | None = "stop") -> None:
        self.module = module
        """The user's model (unwrapped): save and load its state_dict."""
        self.model = model
        """What to call in forward: DDP(module) with several workers, else module."""
        self.optimizer = optimizer
        self.world = world
        self.mesh = mesh if mesh is not None else ParallelMesh(degrees(strategy, world.world_size),
                                                               world)
        """`ParallelMesh`: data, sharding and tensor-parallel degrees, this rank's place, groups."""
        self.strategy = strategy
        self.scaler = scaler
        """fp16 loss scaler, None for bf16 or fp32."""
        self.autocast_dtype = autocast_dtype
        self.avg = bool(avg)
        self.params = [p for p in module.parameters() if p.requires_grad]
        """The trainable parameters, in the order statistics and checkpoints list them."""
        self.pipeline = pipeline
        """`PipelineRunner` of `[pipeline]` runs (drive them with `pipeline_step`), else None."""
        self.clock = ScheduleClock(
            schedule, optimizer, unit_batch_size=int(unit_batch_size or plan.global_batch_size),
            total_steps=int(total_steps if total_steps is not None else schedule.total_steps))
        """`ScheduleClock`: schedule, progress, step counters; the only writer of the LR."""
        # FSDP2 shards the module in place and the module controls gradient sync; torch's
        # pipeline stages switch it themselves.
        fsdp = module if self.mesh.degrees.fsdp_enabled and pipeline is None else None
        self.window = MergeWindow(
            k_steps=plan.k_steps, micro_batch_size=plan.micro_batch_size, avg=avg,
            data_rank=self.mesh.data_rank, params=self.params, device=world.device,
            distributed=world.is_distributed, dp_group=self.mesh.dp_group,
            ddp=model if model is not module else None, fsdp=fsdp,
            # Not tied to k_steps > 1: an adaptive batch size may turn merging on later.
            measure_first=measure_first)
        """`MergeWindow`: micro-step position, loss scaling, gradient sync."""
        self.batch = BatchControl(plan, strategy, self.mesh.data_degree, self.window, self.clock,
                                  fixed=pipeline is not None)
        """`BatchControl`: the batch in force (`plan`) and its changes."""
        self.grad_hooks: list[Callable[[GradInfo], None]] = []
        """Called at each taken step with a GradInfo, after unscale, before the optimizer."""
        self.step_hooks: list[Callable[[Run], None]] = []
        """Called after each taken optimizer step, between steps (batch-size changes go here)."""
        self.state_objects: dict[str, Any] = {}
        """Extra stateful helpers saved in `state_dict()` under their name; those with a
        `stats()` method add to `run.stats`."""
        self.adaptive: Any = None
        """The `[adaptive]` controller (`bigbatch.engine.adaptive.Adaptive`), None when off."""
        self.adasum_delta: Any = None
        """`bigbatch.parallel.adasum_delta.AdasumDelta` when Adasum combines the optimizer's
        weight changes (`data_parallel.adasum_on`)."""
        self.local_sgd: Any = None
        """`bigbatch.parallel.local_sgd.LocalSGD` of `[localsgd]`/`[adaptive_localsgd]` runs on
        several workers, else None."""
        self._policies: Any = None
        self.timing: Any = None
        """A step timer told when each backward ends (`bigbatch.engine.step_timing`), or None."""
        self.last_step_seconds = 0.0
        """Seconds inside the micro-step blocks of the latest optimizer step (no data loading)."""
        self.sync_timing = False
        """Synchronise the device at each micro-step's end so step times are device times."""
        self.device_skip = scaler is not None and pipeline is None \
            and world.device.type == "cuda" and _step.takes_overflow_flag(optimizer)
        """fp16 on CUDA, optimizer taking the flag (`step.takes_overflow_flag`), no gradient
        hooks: the optimizer skips an overflow step on the device and the schedule advances
        (`skipped_steps` counts it); else the flag is read and the step holds the schedule."""
        self.track_grad_norm = track_stats
        """Record the global grad norm at every step for `stats` (one foreach norm)."""
        self.max_grad_norm = strategy.max_grad_norm() if hasattr(strategy, "max_grad_norm") \
            else None
        """Clip the global gradient norm to this before the optimizer (None: no clipping);
        `stats["grad_norm"]` is the norm before clipping."""
        self.pipeline_norms: Any = None
        """A pipeline's noise-scale norms (`bigbatch.engine.pipeline_gns`), None elsewhere."""
        self._loss_parallel = loss_parallel
        # Tensor parallelism may hand gradients back in another layout than the weights.
        self._tp_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad] \
            if self.mesh.degrees.tp_enabled else []
        # Tensor-parallel ranks must read the same inputs: compared at the first micro-step.
        self._inputs_unchecked = self.mesh.degrees.tp_enabled and pipeline is None
        self.unused_check: Any = None
        """`bigbatch.parallel.unused_params.UnusedCheck` in FSDP2 runs over several data
        ranks: names a parameter one rank does not use, in the first steps."""
        self._comm = comm
        self._owns_group = owns_group
        self._step_time = 0.0
        self._grad_norm: torch.Tensor | None = None
        self.nan_guard: LossGuard | None = None
        """`nan_policy` (`bigbatch.engine.nonfinite`): watches the losses of fp32/bf16 runs
        (fp16's loss scaler skips a non-finite step itself); None when off."""
        if nan_policy is not None and scaler is None and pipeline is None:
            self.nan_guard = self.state_objects["nonfinite"] = LossGuard(
                nan_policy, world.device, distributed=world.is_distributed)
        self.nan_check_on_device = (
            world.device.type == "cuda" and _step.takes_overflow_flag(optimizer)
            and (comm is None or comm.state_dict() is None))
        """Check the loss on the device (`bigbatch.engine.nonfinite`): the optimizer skips a
        non-finite step there and the flag is read once it has landed, never waited for
        inside a step. Set on CUDA with an optimizer that takes the overflow flag and no
        comm hook with memory; not while gradient hooks or local SGD run. Else the flag is
        read at each step's last micro-step (one host read)."""
        if track_stats and hasattr(optimizer, "track_trust_ratios"):
            optimizer.track_trust_ratios = True

    # The parts' state, under the names the loop and the checkpoints have always used.
    schedule = _delegate("clock", "schedule", "`Schedule` in force: `schedule.lr(p)` at position p.")
    step = _delegate("clock", "step", "Optimizer steps taken (skipped overflow steps excluded).")
    skipped_steps = _delegate("clock", "skipped_steps", "Steps skipped for inf/nan gradients.")

    @property
    def nonfinite_skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss under `nan_policy="skip"` (waits
        for the flags still on their way; see `nan_check_on_device`)."""
        if self.nan_guard is None:
            return 0
        self.nan_guard.check()
        return self.nan_guard.skipped
    progress = _delegate("clock", "progress", "Where the schedule is read.")
    progress_rate = _delegate("clock", "progress_rate", "Schedule units per step taken.")
    total_steps = _delegate("clock", "total_steps", "Length in schedule units.")
    unit_batch_size = _delegate("clock", "unit_batch_size", "Samples of one schedule unit.")
    last_lr = _delegate("clock", "last_lr", "The latest step's LR.")
    plan = _delegate("batch", "plan", "The BatchPlan in force (global/micro batch, k_steps).")
    batch_size_changes = _delegate("batch", "changes", "Batch changes: step, old, new, reason.")
    k_steps = _delegate("window", "k_steps", "Micro-steps per optimizer step (gradient merge).")
    micro = _delegate("window", "micro", "Position in the merge window, 0 <= micro < k_steps.")
    micro_batch_sizes = _delegate(
        "window", "micro_batch_sizes", "Per data rank micro batches when they differ "
        "(straggler rebalancing), summing to plan.micro_batch_size x data degree; else None. "
        "The loader must follow it; `set_batch` resets it.", settable=True)

    @property
    def lr_scale(self) -> float:
        """Extra LR multiplier on top of the schedule (adaptive methods, policies)."""
        return self.clock.lr_scale

    @lr_scale.setter
    def lr_scale(self, value: float) -> None:
        self.clock.set_lr_scale(value)

    comm = property(lambda self: self._comm,
                    doc="The DDP comm hook's state (`bigbatch.parallel.data_parallel`), or None.")

    @property
    def policies(self) -> Any:
        """`bigbatch.engine.policies.Policies`: the run's policies, bound to this run."""
        return None if self._policies is None else self._policies.bound(self)

    @policies.setter
    def policies(self, policies: Any) -> None:
        self._policies = policies

    # ------------------------------------------------------------- stepping

    def micro_step(self) -> MicroStep:
        """Context for one micro-step's forward and backward (see the module example)."""
        dtype = self.autocast_dtype
        check = self._check_loss if self.nan_guard is not None else None
        if self._inputs_unchecked:
            check = self._check_first
        if self.unused_check is not None and self.unused_check.active:
            check = functools.partial(self._check_unused, check)
        return MicroStep(self.window, scaler=self.scaler, loss_parallel=self._loss_parallel,
                         autocast=None if dtype is None else self._amp_args(),
                         local_sgd=self.local_sgd, timing=self.timing, finish=self._finish_step,
                         skip=self.skip_step, add_time=self._add_step_time, check=check,
                         ended=self._ended_by)

    def _ended_by(self, error: BaseException) -> None:
        """An error leaving a micro-step: one that every rank raised alike
        (`bigbatch.errors.on_every_rank`: unused parameters, tensor ranks' inputs) ends the
        run, and its group goes now, not in the interpreter's exit, where a live gloo
        group's threads abort the process (SIGABRT) after the error is printed."""
        if getattr(error, "on_every_rank", False):
            self.close()

    def _check_first(self, loss: torch.Tensor, is_last: bool) -> bool:
        """The first micro-step under tensor parallelism: the same inputs on every tensor
        rank (`bigbatch.engine.data_share`), then `nan_policy` as on every micro-step."""
        self._inputs_unchecked = False
        check_same_inputs(loss, self.mesh.tp_mesh.get_group(), self.mesh.tensor_rank)
        return self._check_loss(loss, is_last) if self.nan_guard is not None else False

    def _check_unused(self, then: Callable[[torch.Tensor, bool], bool] | None,
                      loss: torch.Tensor, is_last: bool) -> bool:
        """FSDP2's first steps: what this backward reaches against the other data ranks
        (`bigbatch.parallel.unused_params`), then `then`'s check."""
        self.unused_check.before_backward(loss, is_last)
        return then(loss, is_last) if then is not None else False

    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = True) -> Any:
        """A `DistributedSampler` giving this rank its share of `dataset` by the mesh's
        data rank and degree: tensor-parallel and pipeline ranks of one replica read the
        same samples (`bigbatch.engine.data_share`). ``set_epoch(epoch)`` reshuffles."""
        return data_sampler(self.mesh, dataset, shuffle=shuffle, seed=seed,
                            drop_last=drop_last)

    def loader(self, dataset: Any, *, shuffle: bool = True, seed: int = 0,
               **kwargs: Any) -> Any:
        """A `DataLoader` of micro-batches (`plan.micro_batch_size`) over this rank's share
        of `dataset` (`sampler`), like Accelerate's ``prepare(dataloader)``: reshuffle with
        ``loader.sampler.set_epoch(epoch)``. A batch changed later by `set_batch` (the
        adaptive batch) needs a new loader. `kwargs` go to the `DataLoader`."""
        kwargs.setdefault("batch_size", self.plan.micro_batch_size)
        return data_loader(self.mesh, dataset, shuffle=shuffle, seed=seed, **kwargs)

    def _nan_lazy(self) -> bool:
        return self.nan_check_on_device and not self.grad_hooks and self.local_sgd is None

    def _check_loss(self, loss: torch.Tensor, is_last: bool) -> bool:
        """`nan_policy` on one micro-step's loss: True to skip the optimizer step (read
        before the last backward, unless the check runs on the device)."""
        self.nan_guard.observe(loss)
        if not is_last or self._nan_lazy():
            return False
        try:
            return self.nan_guard.decide(self.step + 1)
        except NonFiniteLossError:
            self.skip_step()  # the run stays at a step boundary, its gradients dropped
            raise

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
        mult = self.window.count_mult
        if self.pipeline.asynchronous:  # PipeDream: the stages step per micro-batch
            self.clock.apply()
            total, count = self.pipeline.step(inputs, targets, loss, mult)
            self._end_step(t0, skipped=False)
            return total, count
        scale = self.scaler.scale if self.scaler is not None else None
        if self.scaler is not None:
            # Stages before the last never scale a loss themselves, yet unscale the
            # (scaled) gradients they receive: GradScaler must have its scale ready.
            self.scaler.scale(torch.ones((), device=self.world.device))
        with self.autocast():
            total, count = self.pipeline.step(inputs, targets, loss, mult, scale)
        # The global item count: the reporting ranks' counts (one per data rank), summed.
        global_count = count.to(self.world.device, copy=True)
        all_reduce_sum(global_count)
        self.window.set_counts(float(count), global_count)
        self._finish_step(t0)
        return total, count

    def autocast(self) -> Any:
        """The strategy's autocast context (a no-op without `[amp]`): for evaluation and any
        forward outside `micro_step()`, so it runs in the precision training used."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return amp_context(*self._amp_args())

    def _amp_args(self) -> tuple[Any, ...]:
        """autocast's device type and dtype, and [amp]'s custom white and black lists."""
        amp = self.strategy.amp
        return (self.world.device.type, self.autocast_dtype, amp.custom_white_list,
                amp.custom_black_list)

    def loss_parallel(self) -> Any:
        """Context for a loss computed outside `micro_step()` (evaluation): torch's
        `loss_parallel()` when tensor parallelism keeps the logits sharded on the
        vocabulary, else a no-op."""
        from bigbatch.parallel.tensor_parallel import loss_parallel_if

        return loss_parallel_if(self._loss_parallel)

    def lr_at(self, progress: float) -> float:
        """Learning rate the optimizer gets at schedule position `progress`."""
        return self.clock.lr_at(progress)

    done = _delegate("clock", "done", "Whether the schedule's length is reached.")

    def _add_step_time(self, t0: float) -> None:
        if self.sync_timing and self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        self._step_time += time.perf_counter() - t0

    def set_batch(self, micro_batch_size: int, k_steps: int) -> None:
        """Use ``global = micro x k_steps x world_size`` from the next optimizer step on.

        The peak LR follows `batch.scaling` for the new global batch, and progress
        advances by ``global / unit_batch_size`` per step, so the run's length stays
        in samples. Call between optimizer steps; the loader must follow `run.plan`.
        """
        self.batch.set(micro_batch_size, k_steps)

    def apply_gradients(self, grads: list[torch.Tensor | None]) -> None:
        """One optimizer step on gradients computed elsewhere (a parameter server's combined
        gradient), one per trainable parameter, already in the optimizer's units: the step
        that ends a merge window (schedule LR, statistics, step hooks), without backward."""
        if self.window.micro:
            raise RuntimeError("run.apply_gradients() inside a merge window")
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        self._finish_step(time.perf_counter())

    def synchronize(self) -> None:
        """Local SGD: average the workers' weights and optimizer state now (before evaluating
        or saving; `state_dict()` does it itself). Every worker calls it; else a no-op."""
        if self.local_sgd is not None:
            self.local_sgd.synchronize()
        if self.adasum_delta is not None:  # per-worker moments under Adasum on deltas
            self.adasum_delta.synchronize()

    def skip_step(self) -> None:
        """Drop the merge window's gradients: no optimizer step, the schedule stays. For a
        step that must not count (a non-finite loss): call it instead of `ms.backward()`
        (`ms.skip()`) or between micro-steps; every worker must skip the same step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.window.reset()
        self._step_time = 0.0
        if self.nan_guard is not None:
            self.nan_guard.reset()

    def _finish_step(self, t0: float) -> bool:
        """The window's gradients are reduced: the step's stages in order. True if skipped.

        `t0`: when the last micro-step's block was entered (step timing).
        """
        window, params = self.window, self.params
        # nan_policy on the device: the optimizer skips a non-finite step like an overflow.
        nan_flag = self.nan_guard.take(self.step + 1) \
            if self.nan_guard is not None and self._nan_lazy() else None
        local_count = window.count
        total_count = window.total_count() if window.mode == "count" else local_count
        if self._tp_params:
            _step.align_grads(self._tp_params)
        _step.normalize(window, params, self.mesh.data_degree)
        found_inf = _step.unscale(self.scaler, self.optimizer)
        flag, skipped = _step.overflow(found_inf, self.device_skip and not self.grad_hooks)
        if nan_flag is not None:
            flag = nan_flag
        # Taken every step: the comm hook starts a new sum once it is taken.
        local_raw = self._comm.take_local_sq() if self._comm is not None else None
        if not skipped:
            info = _step.statistics(self.grad_hooks, lambda: self._grad_info(
                local_raw, local_count, total_count))
            if self.track_grad_norm or self.max_grad_norm is not None:
                self._grad_norm = _step.grad_norm(params, info, self.pipeline)
            if self.max_grad_norm is not None:
                _step.clip(params, self._grad_norm, self.max_grad_norm)
            self.clock.apply()
            _step.optimizer_step(self.optimizer, self.module.named_parameters, flag)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        window.reset()
        self._end_step(t0, skipped=skipped, flagged=flag)
        return skipped

    def _end_step(self, t0: float, skipped: bool, flagged: torch.Tensor | None = None) -> None:
        self._add_step_time(t0)
        self.last_step_seconds, self._step_time = self._step_time, 0.0
        if skipped:
            self.clock.skip()
            return
        if flagged is not None:  # the optimizer may have skipped it on the device
            self.clock.advance_flagged(flagged)
        else:
            self.clock.advance()
        for hook in self.step_hooks:
            hook(self)

    def _grad_info(self, local_raw: torch.Tensor | None, local_count: Any,
                   total_count: Any) -> GradInfo:
        if self.pipeline_norms is not None:
            return self.pipeline_norms.grad_info(self.step, local_count, total_count)
        scale = self.scaler.scale_value if self.scaler is not None else 1.0
        return grad_info(self.step, self.params, self.window, scale, self.mesh.data_degree,
                         local_raw, local_count, total_count)

    def grad_factor(self) -> float | torch.Tensor:
        """What the step multiplies the reduced gradients by: with `count=` losses the count
        normalisation (1 for mean losses). A stateful reduce (DGC) reads it during the last
        backward to accumulate in the optimizer's units."""
        return self.window.grad_factor(self.mesh.data_degree)

    # ------------------------------------------------------------- reporting, resume

    @property
    def stats(self) -> dict[str, float]:
        """Numbers for logging, read on access (a device sync on GPU for norms): step, lr,
        skipped steps, loss scale, grad norm, trust ratios and the helpers' `stats()`."""
        helpers = list(self.state_objects.values())  # `nan_guard` waits for its flags
        if self._comm is not None:
            helpers.append(self._comm.inner_state)
        return _run_state.stats(self.clock, self.scaler, self._grad_norm, self.optimizer, helpers)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, loss scaler, counters, schedule position, batch and registered helpers.

        Call it on every rank: with ZeRO stage 1 it gathers the optimizer state to rank 0
        (the others get None there); with FSDP2 or tensor parallelism the optimizer's
        state is left to DCP (`bigbatch.train.sharded`) and is None here.
        Taken mid-merge-window it also holds this worker's accumulated gradients
        (per rank under DDP); at a step boundary (`ms.stepped`) it holds none.
        """
        self.synchronize()  # local SGD: what is saved is what every worker holds
        if self.pipeline is not None:
            self.pipeline.settle()  # PipeDream: no update left in flight
        return _run_state.state_dict(self, self._comm)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (the model's weights are loaded separately).

        On another world size (or a changed batch configuration) the batch follows
        `bigbatch.config.elastic.resume_plan` and the schedule keeps the checkpoint's unit;
        registered helpers (noise scale, AdaScale, goodput) load first and carry over.
        """
        _run_state.load_state_dict(self, state, self._comm)

    def save_state(self, directory: Any, extra: dict[str, Any] | None = None) -> Any:
        """Collective: model (DCP shards when sharded), optimizer, LR clock, loss scaler,
        RNG, adaptive and policy state and your `extra` dict, atomically into `directory`
        (`bigbatch.engine.saving`)."""
        return _saving.save_state(self, directory, extra)

    def load_state(self, directory: Any) -> dict[str, Any]:
        """Collective: restore a `save_state` directory (resharding on another world size);
        returns its `extra` dict."""
        return _saving.load_state(self, directory)

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the unsplit model's state dict on rank 0 (for `save_pretrained`)."""
        return _saving.whole_state_dict(self)

    def close(self) -> None:
        """Tear down the process group if `prepare()` created it."""
        if self._owns_group:
            # DDP's reducer must go before the process group it uses: dropped here,
            # collected by `teardown` before the group goes (see `train.train`).
            self.model = self.module
            self.window.set_ddp(None)
            if self.pipeline is not None:
                self.pipeline.close()
            teardown()
            self._owns_group = False
