"""`prepare()`: a model and a Strategy in, the `Run` that drives the loop out: the device
mesh, pipeline stages, tensor-parallel slices, FSDP2 or DDP, the optimizer, the loss
scaler, in that order. The package docstring (`bigbatch.engine`) is the guide."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.config.comm import adasum_target, local_sgd_section
from bigbatch.config.compat import Context, check
from bigbatch.config.parallelism import check_pipeline_plan, degrees
from bigbatch.engine import adaptive as _adaptive
from bigbatch.engine import policies as _policies
from bigbatch.engine.amp import LossScaler, amp_dtype
from bigbatch.engine.nonfinite import check_policy
from bigbatch.engine.optimizer import build_optimizer, replica_group, weight_decays
from bigbatch.engine.parallelize import parallelize
from bigbatch.engine.recompute import check_recompute
from bigbatch.engine.run import Run
from bigbatch.parallel.data_parallel import check_reduce, wrap_data_parallel
from bigbatch.parallel.mesh import ParallelMesh
from bigbatch.parallel.model_plan import ModelPlan
from bigbatch.parallel.sharding import fsdp_reduces_unused, reduce_unused
from bigbatch.parallel.world import World, init_distributed

__all__ = ["prepare"]


def prepare(model: nn.Module, strategy: Any, total_steps: int, steps_per_epoch: int | None = None,
            world: World | None = None, *, track_stats: bool = False,
            local_grad_norm: bool | None = None, plan: Any = None,
            tp_plan: Any = None, pipeline_layers: Any = None,
            optimizer: torch.optim.Optimizer | None = None,
            policies: list[Any] | None = None, model_plan: Any = None,
            samples_per_epoch: int | None = None, nan_policy: str | None = "stop") -> Run:
    """Apply `strategy` to `model` and return the `Run` that drives the training loop.

    `total_steps` and `steps_per_epoch` count optimizer steps (one per global
    batch); `steps_per_epoch` is needed only for `batch.warmup_epochs`:
    `samples_per_epoch=len(train_set)` gives it from the data set (global batches per
    epoch, as `bigbatch.engine.schedule_steps` counts them). `world`
    defaults to `World.from_env()`; with more than one worker the process group
    is created from `data_parallel` unless one exists. `track_stats` records the
    grad norm and trust ratios for `run.stats`. `local_grad_norm` measures each
    worker's pre-all-reduce gradient norm for grad hooks (scalars only; default:
    on when `[adaptive]` needs the noise scale; a pipeline measures its first
    micro-batch whenever `[adaptive]` is active). With `[adaptive]` active the run
    gets `run.adaptive` (see the module docstring for training length and the
    adaptive-batch loader contract). `plan` replaces `strategy.resolve(data_degree)`, e.g.
    `bigbatch.config.elastic.resume_plan(...)` for a checkpoint from another world size.

    `[sharding]` and `[tensor_parallel]` lay the world out as a device mesh
    (`run.mesh`): `tp_plan` says how to slice `model` for tensor parallelism (a dict
    of module name to style, or a `parallelize(model, mesh)` callable; see
    `bigbatch.parallel.tensor_parallel`), then FSDP2 shards it over the data ranks.
    The batch's "world" is the data-parallel degree. `[pipeline]` splits the model into
    stages (`pipeline_layers`: its chain of `bigbatch.parallel.pipeline.Layer`s, default
    `model.pipeline_layers()`); `run.module` is then this rank's stage, and
    `run.pipeline_step()` replaces the micro-steps. With data parallelism too, the stages
    are FSDP2 modules, or DDP modules when `[adaptive]` is active without `[sharding]`
    (the noise scale measures micro-batch 0's gradient on each data rank).

    `optimizer`: your own `torch.optim.Optimizer` over `model`'s parameters (Adafactor,
    Muon, Shampoo, 8-bit Adam, ...) instead of the one the strategy names. Merge, AMP,
    clipping, data parallelism, LR scaling and the schedule apply; the schedule sets each
    param group's ``lr`` (times the group's ``lr_scale``, default 1). A strategy with
    `[lars]` or `[lamb]` is then a ConfigError, as is a sharded, sliced or pipelined run
    (they replace the parameters your optimizer holds).

    `model_plan`: a `bigbatch.parallel.model_plan.ModelPlan`, what the model contributes
    to parallelism in one place (its block classes for FSDP2, its tensor-parallel plan,
    its pipeline layers); `tp_plan=` and `pipeline_layers=` given here take precedence.

    `policies`: `bigbatch.Policy` objects, or names as in ``[adaptive] policies`` (added
    to `run.strategy`), run after those of the strategy (`run.policies`).

    `nan_policy`: what a non-finite loss given to `ms.backward` does, as `bigbatch train
    --nan-policy`: ``"stop"`` (default) raises `bigbatch.errors.NonFiniteLossError` naming
    the optimizer step, before that step touches a weight; ``"skip"`` skips the step
    (`ms.skipped`, counted in `run.nonfinite_skipped_steps`) and raises after
    `bigbatch.engine.nonfinite.MAX_NONFINITE_SKIPS` consecutive ones; None turns the check
    off. fp16 runs leave it to the loss scaler, and `[pipeline]` runs have none. On CUDA
    the check may run on the device and raise a few steps late (`bigbatch.engine.nonfinite`).
    """
    from bigbatch.config.schedules import Schedule

    if nan_policy is not None:
        check_policy(nan_policy)
    world = world if world is not None else World.from_env()
    model_plan = model_plan if model_plan is not None else ModelPlan()
    tp_plan = tp_plan if tp_plan is not None else model_plan.tp_plan
    pipeline_layers = pipeline_layers if pipeline_layers is not None else \
        model_plan.pipeline_layers
    model_plan = dataclasses.replace(model_plan, tp_plan=tp_plan,
                                     pipeline_layers=pipeline_layers)
    names = tuple(p for p in policies or () if isinstance(p, str))
    if names:
        strategy = dataclasses.replace(strategy, adaptive=dataclasses.replace(
            strategy.adaptive, policies=strategy.adaptive.policies + names))
    deg = degrees(strategy, world.world_size)
    if plan is None:
        plan = strategy.resolve(deg.data)
    if steps_per_epoch is None and samples_per_epoch is not None:
        steps_per_epoch = _adaptive.schedule_steps(strategy, deg.data, samples_per_epoch, 1.0,
                                                   _adaptive.unit_of(strategy, plan))[1]
    schedule = Schedule.from_strategy(strategy, plan, total_steps, steps_per_epoch)
    dp = strategy.data_parallel
    check_reduce(getattr(dp, "reduce", "mean"))
    amp = strategy.amp
    autocast_dtype = amp_dtype(amp.dtype) if amp.enable else None
    # What the strategy cannot do with this model, optimizer and worker (and, with a run,
    # cannot do at all): the table's rows, before any process group exists.
    check(strategy, Context(run=True, own_optimizer=optimizer is not None,
                            tp_plan=tp_plan is not None, distributed=world.is_distributed,
                            device=world.device.type, fsdp_unused=fsdp_reduces_unused()))
    if dp.sync_batch_norm and world.is_distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if strategy.recompute.enable:  # names checked on the whole model, before any group
        check_recompute(model, list(strategy.recompute.checkpoints))
    if strategy.gradient_merge.enable and strategy.gradient_merge.bn_momentum == "merged":
        from bigbatch.engine.bn_merge import merge_bn_momentum

        merge_bn_momentum(model, plan.k_steps)
    needs_gns = _adaptive.check(strategy, plan)  # before any process group exists
    if local_grad_norm is None:
        local_grad_norm = needs_gns

    if deg.tp_enabled and isinstance(tp_plan, Mapping):
        from bigbatch.parallel.tensor_parallel import expand_plan

        # On the whole model, before a pipeline keeps one stage of it: an entry that names
        # no module (a typo) would otherwise leave that layer replicated without a word.
        expand_plan(model, tp_plan)
    owns_group = world.is_distributed and not dist.is_initialized()
    init_distributed(dp, world)
    mesh = ParallelMesh(deg, world)
    pipeline = None
    if deg.pp_enabled:
        from bigbatch.parallel.pipeline import model_layers
        from bigbatch.parallel.pipeline_schedule import PipelineRunner

        layers = pipeline_layers if pipeline_layers is not None else model_layers(model)
        pipeline = PipelineRunner(model, layers, mesh, strategy.pipeline)
        model = pipeline.module
        if needs_gns:
            from bigbatch.engine.pipeline_gns import check_measurable

            check_measurable(pipeline)  # before any stage is wrapped
    model.to(world.device)
    # DDP stages when the noise scale needs micro-batch 0's gradient in `.grad`
    # (`bigbatch.engine.pipeline_gns`); FSDP2 accumulates in private copies.
    ddp_stages = (pipeline is not None and deg.dp_enabled and not deg.stage
                  and not deg.tp_enabled and needs_gns)
    lay_out = model_plan.parallelize or parallelize
    loss_parallel = bool(lay_out(
        model, mesh, strategy, model_plan, stage_of=pipeline, fsdp=not ddp_stages,
        param_dtype=torch.bfloat16 if autocast_dtype == torch.bfloat16 else None))
    if ddp_stages:
        pipeline.replicate(world.device, float(dp.bucket_cap_mb))
    inner, opt_strategy = None, strategy
    if world.is_distributed and not deg.needs_mesh:  # DDP over the default group
        from bigbatch.parallel.compression import DGC_OPTIMIZER, DGCState, reduce_hook

        trainable = [p for p in model.parameters() if p.requires_grad]
        decay = weight_decays(model, strategy)
        inner = reduce_hook(strategy, trainable, weight_decays=[decay[id(p)] for p in trainable])
        if inner is not None and isinstance(inner[1], DGCState):  # the hook owns momentum
            opt_strategy = dataclasses.replace(
                strategy, optimizer=dataclasses.replace(strategy.optimizer, **DGC_OPTIMIZER))
    if optimizer is None:
        optimizer = build_optimizer(model, opt_strategy, lr=schedule.lr(0), zero=deg.zero1_enabled,
                                    replicas=replica_group(strategy, mesh))
    if pipeline is not None:
        check_pipeline_plan(strategy, plan.k_steps)
        pipeline.start(world.device, plan.k_steps, optimizer)
    local = None
    if world.is_distributed and (section := local_sgd_section(strategy)) is not None:
        from bigbatch.parallel.local_sgd import LocalSGD

        local = LocalSGD([p for p in model.parameters() if p.requires_grad], optimizer, section)
        inner = local.hook
    elif (world.is_distributed and not deg.needs_mesh
          and "sync_switch" in strategy.adaptive.policies):  # the policy may go local
        from bigbatch.parallel.switchable_reduce import SwitchableReduce

        local = SwitchableReduce([p for p in model.parameters() if p.requires_grad], optimizer,
                                 strategy.sync_switch.k_steps)
        inner = local.hook
    delta = None
    if world.is_distributed and not deg.needs_mesh and adasum_target(strategy) == "delta":
        from bigbatch.parallel.adasum_delta import AdasumDelta, keep_local_hook

        delta = AdasumDelta(list(model.parameters()), optimizer)
        inner = (keep_local_hook, None)
    wrapped, comm = model, None
    if world.is_distributed and not deg.needs_mesh:
        wrapped, comm = wrap_data_parallel(model, world.device, dp, bool(local_grad_norm), inner)
    scaler = None
    if autocast_dtype == torch.float16:
        scaler = LossScaler.from_config(amp, world.device.type, sharded=deg.sharded_state)
    run = Run(module=model, model=wrapped, optimizer=optimizer, schedule=schedule, world=world,
              plan=plan, strategy=strategy, scaler=scaler, autocast_dtype=autocast_dtype,
              avg=strategy.gradient_merge.avg, comm=comm, owns_group=owns_group,
              track_stats=track_stats, total_steps=total_steps,
              measure_first=bool(local_grad_norm) and not world.is_distributed,
              unit_batch_size=_adaptive.unit_of(strategy, plan), mesh=mesh,
              loss_parallel=loss_parallel, pipeline=pipeline, nan_policy=nan_policy)
    if comm is not None and hasattr(comm.inner_state, "grad_factor"):
        comm.inner_state.grad_factor = functools.partial(run.window.grad_factor,
                                                         mesh.data_degree)
    if delta is not None:
        run.adasum_delta = delta
    if world.is_distributed and deg.fsdp_enabled and pipeline is None and mesh.data_degree > 1:
        from bigbatch.parallel.unused_params import UnusedCheck

        run.unused_check = UnusedCheck(
            model, mesh.dp_group, world.device, step=lambda: run.step + 1,
            reduced=reduce_unused(strategy, deg.stage),
            can_reduce=deg.stage >= 2 and fsdp_reduces_unused())
    if local is not None:
        run.local_sgd = run.state_objects["local_sgd"] = local
        run.step_hooks.append(lambda r: local.after_step(r.step, r.last_lr))
    if needs_gns:
        _adaptive.attach(run)
    if strategy.kfac.enable:
        from bigbatch.engine.kfac import attach_kfac

        attach_kfac(run)
    _policies.attach(run, [p for p in policies or () if not isinstance(p, str)])
    return run
