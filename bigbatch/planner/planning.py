"""`plan()`: how a run lays out on N ranks, without N ranks and without the model's weights.

For each pipeline stage it builds the model on the meta device, becomes that stage's
first rank on torch's fake process group, and applies the strategy's layout through the
engine's own steps (`bigbatch.planner.layout`); then measures what that rank holds, runs
one micro-batch and two optimizer steps on meta to count what they send (the first) and
cost (the second, a steady one), and adds the data-parallel and pipeline traffic by
arithmetic (`bigbatch.planner.traffic`).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.config.compat import Context, check
from bigbatch.config.parallelism import check_pipeline_plan, degrees
from bigbatch.errors import ConfigError
from bigbatch.optim._norms import local
from bigbatch.parallel.data_parallel import check_reduce
from bigbatch.planner.cost import OpCost, cost_counting
from bigbatch.planner.counting import CommCount, counting
from bigbatch.planner.fake import fake_world
from bigbatch.planner.layout import RankLayout, lay_out, stage_runs
from bigbatch.planner.probe import probe
from bigbatch.planner.result import LayoutPlan, RankPlan
from bigbatch.planner.traffic import (
    ddp_traffic,
    fsdp_gathers,
    fsdp_traffic,
    item_count_traffic,
    nonfinite_flag_traffic,
    pipeline_traffic,
    schedule_order,
)

__all__ = ["plan", "plan_task", "task_parts"]

Example = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""``example(micro_batch_size) -> (inputs, targets)``: one micro-batch (any device; only
shapes and dtypes are used)."""


def plan(model_fn: Callable[[], nn.Module], strategy: Any, world: int, *,
         example: Example | None = None, loss: Callable | None = None, tp_plan: Any = None,
         pipeline_layers: Sequence[Any] | None = None,
         gpu_memory: float | None = None) -> LayoutPlan:
    """Lay `strategy` out for `world` ranks on the model `model_fn()` builds, and report.

    `model_fn` is called under ``torch.device("meta")``, once per pipeline stage: it must
    build the model from scratch (no weights are allocated, so any size plans in seconds).
    `example(micro_batch_size)` gives one micro-batch ``(inputs, targets)`` for the
    activation estimate, the tensor-parallel traffic and the pipeline's sends (without it
    those are not measured). Its contract: a function of one int, the micro-batch size
    ``b``, returning a pair of tensors whose first dimension is ``b``: ``inputs`` is what
    ``model(inputs)`` takes, ``targets`` what `loss` takes; any device (meta is cheapest:
    only shapes and dtypes are used), e.g.
    ``lambda b: (torch.zeros(b, 2048, dtype=torch.long),) * 2``. Anything else is a
    one-line ConfigError naming what it gave; `loss(output, targets)` returns the loss (or ``(sum, count)``;
    default: a gradient of ones on the output). `tp_plan` and `pipeline_layers` as in
    `bigbatch.prepare`. `gpu_memory`: GiB per GPU to check the plan against.

    A layout `prepare()` would refuse raises its ConfigError (degrees that do not divide
    `world`, fewer micro-batches than stages, a tensor plan that does not divide a layer).
    """
    return _plan(model_fn, strategy, world, example=example, loss=loss,
                 tp_plan_of=lambda model: tp_plan, tp_given=tp_plan is not None,
                 pipeline_layers=pipeline_layers, gpu_memory=gpu_memory)


_EXPECTED = ("expected a function of the micro-batch size returning (inputs, targets), two "
             "tensors whose first dimension is that size, e.g. lambda b: (torch.zeros(b, 128, "
             "dtype=torch.long),) * 2")


def _check_example(example: Any) -> torch.Tensor:
    """`example(2)`'s inputs, once `example` keeps `Example`'s contract; else ConfigError
    in one line naming what it gave and what was expected."""
    if not callable(example):
        raise ConfigError(f"plan(example=...): got a {type(example).__name__}; {_EXPECTED}")
    try:
        got = example(2)
    except Exception as e:  # a user's function: its failure, named, in one line
        raise ConfigError(f"plan(example=...): example(2) raised {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}; {_EXPECTED}") from e
    if not isinstance(got, tuple | list) or len(got) != 2:
        what = (f"a {type(got).__name__} of {len(got)}" if isinstance(got, tuple | list)
                else f"a {type(got).__name__}")
        raise ConfigError(f"plan(example=...): example(2) returned {what}; {_EXPECTED}")
    for name, t in zip(("inputs", "targets"), got, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"plan(example=...): example(2)'s {name} is a "
                              f"{type(t).__name__}; {_EXPECTED}")
        if t.dim() == 0 or t.shape[0] != 2:
            raise ConfigError(f"plan(example=...): example(2)'s {name} have shape "
                              f"{tuple(t.shape)}, not 2 x ...; {_EXPECTED}")
    return got[0]


def _refuse_unplanned(strategy: Any) -> None:
    if strategy.parameter_server.enable:
        raise ConfigError("bigbatch plan: [parameter_server] is not planned (its servers hold "
                          "the state); plan the workers' layout without it")
    if strategy.pipeline.enable and strategy.pipeline.schedule_mode == "PipeDream":
        raise ConfigError('bigbatch plan: pipeline.schedule_mode = "PipeDream" is not planned '
                          "(its stashed weight versions); plan 1F1B for the layout")


def _plan(model_fn: Callable[[], nn.Module], strategy: Any, world: int, *,
          example: Example | None, loss: Callable | None,
          tp_plan_of: Callable[[nn.Module], Any], tp_given: bool,
          pipeline_layers: Sequence[Any] | None, gpu_memory: float | None,
          check_tensor: Callable[[int], None] | None = None,
          probes: dict | None = None, ends_only: bool = False) -> LayoutPlan:
    """`plan`'s body; `probes` keeps micro-batch probes between plans of one model that
    differ only in how they shard the state (the ZeRO stage does not change activations
    or TP traffic), the layers' inputs, and the built meta model (each plan lays out a
    copy);
    `ends_only` simulates a pipeline's first and last stage only (a quick look: the first
    holds the most micro-batches, the last the head and the loss)."""
    started = time.perf_counter()
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world={world!r}: expected an integer >= 1")
    _refuse_unplanned(strategy)
    deg = degrees(strategy, world)
    batch = strategy.ceiling(deg.data)  # a growing batch's largest: what memory must hold
    check(strategy, Context(run=True, tp_plan=tp_given, distributed=world > 1,
                            device="cuda", world_size=world))
    check_reduce(strategy.data_parallel.reduce)
    check_pipeline_plan(strategy, batch.k_steps)
    if deg.tp_enabled and check_tensor is not None:
        check_tensor(deg.tensor)
    pipe = strategy.pipeline
    result = LayoutPlan(world=world, degrees=deg, batch=batch, parameters=0,
                        optimizer_name=strategy.optimizer_name(),
                        schedule=pipe.schedule_mode if deg.pp_enabled else None,
                        virtual=pipe.virtual_stages if deg.pp_enabled else 1,
                        ranks=[], gpu_memory=gpu_memory, strategy=strategy)
    if example is not None:
        inputs = _check_example(example)
        if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() \
                and inputs.dim() >= 2:
            result.tokens_per_sample = int(inputs[0].numel())
    stages = range(deg.pipeline)
    if ends_only and deg.pipeline > 2:
        stages = [0, deg.pipeline - 1]
        result.notes.append(f"stages 0 and {deg.pipeline - 1} of {deg.pipeline} simulated")
    for stage in stages:
        rank = stage * deg.data * deg.tensor
        result.ranks.append(_plan_rank(rank, model_fn, strategy, deg, batch, result,
                                       example=example, loss=loss, tp_plan_of=tp_plan_of,
                                       pipeline_layers=pipeline_layers,
                                       probes=probes if probes is not None else {}))
    if example is None:
        result.notes.append("no example input: activations, tensor-parallel and pipeline "
                            "traffic not measured")
    result.seconds = time.perf_counter() - started
    return result


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = local(t).untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def _state_tensors(optimizer: Any, params: Sequence[torch.Tensor] | None = None):
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's
    keys = inner.state.keys() if params is None else params
    return [v for p in keys for v in inner.state.get(p, {}).values()
            if isinstance(v, torch.Tensor)]


def _meta_step(layout: RankLayout, strategy: Any, optimizer: Any) -> tuple[CommCount, OpCost]:
    """Two optimizer steps on meta gradients (clipping first when the strategy clips): the
    state the first creates is the optimizer's own layout and what it sends is counted;
    the second, a steady step like every one a run times after its first, is costed. The
    first step's operators are left out: it fills the new state (two ``zeros_like`` a
    parameter for AdamW, each a kernel), which no later step does."""
    params = [p for p in layout.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)

    def step() -> None:
        clip = strategy.max_grad_norm()
        if clip is not None:
            from bigbatch.engine.step import clip as clip_grads
            from bigbatch.engine.step import grad_norm

            clip_grads(params, grad_norm(params, None, layout.pipeline), clip)
        optimizer.step()

    count, cost = CommCount(), OpCost()
    with counting(count, layout.names):
        step()
    with counting(CommCount(), layout.names), cost_counting(cost):
        step()
    return count, cost


def _fresh_model(model_fn: Callable[[], nn.Module], cache: dict) -> nn.Module:
    """`model_fn()` on meta; between the plans of one `suggest` (a shared `cache`), a copy
    of the first build: a meta model copies in milliseconds (no storage), and building a
    large one costs a tenth of a second or more each time."""
    key = "model"  # one cache holds one model's plans (see `_plan`'s `probes`)
    if key not in cache:
        with torch.device("meta"):
            built = model_fn()
        if all(p.is_meta for p in built.parameters()):
            cache[key] = built
        else:
            return built
    return copy.deepcopy(cache[key])


def _zero1_fullest(layout: RankLayout, strategy: Any) -> int:
    """ZeRO-1's largest per-rank state: its partition of whole tensors (torch's), each
    tensor's state measured by a step of the same optimizer over all of them."""
    from bigbatch.engine.optimizer import build_optimizer

    whole = build_optimizer(layout.module, strategy, lr=1e-3)
    whole.step()
    # torch's own assignment of tensors to ranks (ZeroRedundancyOptimizer's greedy split).
    partitions = layout.optimizer._partition_parameters()
    return max(_unique_bytes(_state_tensors(whole, [p for g in groups for p in g["params"]]))
               for groups in partitions)


def _in_flight(schedule: str | None, micro: int, stage: int, stages: int, virtual: int) -> float:
    """Micro-batches whose activations a stage holds at once: 1 without a pipeline; GPipe
    all m; 1F1B ``min(m, p - stage)``; interleaved: torch's warmup of
    ``(v-1) p + 2 (p - 1 - rank)`` chunk forwards, in stage units."""
    if schedule is None:
        return 1.0
    if schedule == "GPipe":
        return float(micro)
    if virtual == 1:
        return float(min(micro, stages - stage))
    warmup = (virtual - 1) * stages + 2 * (stages - 1 - stage) + 1
    return min(warmup, virtual * micro) / virtual


def _plan_rank(rank: int, model_fn: Callable[[], nn.Module], strategy: Any, deg: Any,
               batch: Any, result: LayoutPlan, *, example: Example | None,
               loss: Callable | None, tp_plan_of: Callable[[nn.Module], Any],
               pipeline_layers: Sequence[Any] | None, probes: dict) -> RankPlan:
    amp = strategy.amp
    from bigbatch.engine.amp import amp_dtype

    autocast = amp_dtype(amp.dtype) if amp.enable else None
    bf16_params = amp.enable and amp.dtype == "bfloat16"
    checkpoints = list(strategy.recompute.checkpoints) if strategy.recompute.enable else []
    micro, k = batch.micro_batch_size, batch.k_steps
    x = y = None
    if example is not None:
        x, y = (t.to("meta") if isinstance(t, torch.Tensor) else t for t in example(micro))

    key = (deg.tensor, deg.pipeline, rank // (deg.data * deg.tensor), micro)

    def run_probe(module, pipeline, names, layers, inputs):
        if x is None:
            return None
        if key in probes:
            return probes[key]
        context = contextlib.nullcontext
        if deg.tp_enabled:
            from bigbatch.parallel.tensor_parallel import loss_parallel_if

            context = lambda: loss_parallel_if(module)  # noqa: E731
        probes[key] = probe(module, stage_runs(module, pipeline, layers, inputs, x), names,
                            loss=loss, targets=y, amp_dtype=autocast,
                            gathered_weights=deg.fsdp_enabled and bf16_params,
                            recomputed=checkpoints, loss_context=context)
        return probes[key]

    with fake_world(rank, result.world) as world:
        model = _fresh_model(model_fn, probes)
        if not result.parameters:
            result.parameters = sum(p.numel() for p in model.parameters())
        layout = lay_out(model, strategy, deg, world, tp_plan=tp_plan_of(model),
                         pipeline_layers=pipeline_layers, probe=run_probe, example=x,
                         cache=probes)
        module, mesh, pipeline, names = layout.module, layout.mesh, layout.pipeline, layout.names
        step, step_cost = _meta_step(layout, strategy, layout.optimizer)
        params = list(module.parameters())
        trainable = [p for p in params if p.requires_grad]
        out = RankPlan(rank=rank, stages=list(pipeline.stage_ids) if pipeline else [0],
                       params=_unique_bytes(params), grads=_unique_bytes(trainable),
                       optimizer=_unique_bytes(_state_tensors(layout.optimizer)),
                       activations=layout.probe.activations if layout.probe else None)
        if deg.zero1_enabled and hasattr(layout.optimizer, "_partition_parameters"):
            out.optimizer = _zero1_fullest(layout, strategy)
        if deg.fsdp_enabled and deg.params_sharded and strategy.sharding.offload:
            out.offloaded = True
            out.notes.append("sharding.offload: sharded parameters, gradients and optimizer "
                             "state in host memory; the peak counts what stays on the GPU")
        stage0 = out.stages[0]
        out.in_flight = _in_flight(result.schedule, k, stage0, deg.pipeline * result.virtual,
                                   result.virtual)
        out.step_comm, out.optimizer_cost = step, step_cost
        if layout.probe is not None:
            out.micro_comm, out.compute = layout.probe.comm, layout.probe.cost
        comm = out.data_comm  # what follows: the reductions, sends and counts by arithmetic
        if deg.pp_enabled:
            if layout.probe is not None:
                pipeline_traffic(comm, layout.probe.sent, layout.probe.received, k, module,
                                 pipeline.tied, mesh.pp_group, names)
            if world.is_distributed:
                item_count_traffic(comm, dist.group.WORLD, names)
        elif world.is_distributed:
            item_count_traffic(comm, mesh.dp_group, names)
            if not (strategy.amp.enable and strategy.amp.dtype == "float16"):
                nonfinite_flag_traffic(comm, dist.group.WORLD, names)
        shard = deg.shard
        if deg.fsdp_enabled:
            order = (schedule_order(result.schedule, k, stage0, deg.pipeline * result.virtual)
                     if deg.pp_enabled else "FB" * k)
            gathers = fsdp_gathers(deg.stage, order, keep_after_backward=deg.pp_enabled)
            fsdp_traffic(comm, layout.fsdp_groups, mesh, names, zero_stage=deg.stage,
                         gathers=gathers, gather_itemsize=2 if bf16_params else None,
                         reduce_itemsize=4 if bf16_params else None)
            if shard > 1:
                gathered = sorted((_unique_bytes(g) * shard // (2 if bf16_params else 1)
                                   for g in layout.fsdp_groups), reverse=True)
                keep_all = deg.stage == 2 or deg.pp_enabled
                out.buffers = sum(gathered if keep_all else gathered[:2])
                if k > 1:
                    out.accumulated_grads = sum(
                        _unique_bytes([p]) // local(p).element_size() * shard
                        * (4 if bf16_params else local(p).element_size()) for p in trainable)
                    out.notes.append(
                        f"ZeRO-{deg.stage} with {k} micro-batches a step keeps unsharded "
                        "gradients between them (FSDP2 reduce-scatters at the last one)")
        elif world.is_distributed and deg.data > 1:
            from bigbatch.config.comm import LOSSY, reduce_mode

            mode = reduce_mode(strategy)
            ddp_traffic(comm, trainable, names, 2 if mode in ("fp16", "bf16") else None,
                        dist.group.WORLD)
            out.buffers = _unique_bytes(trainable)  # DDP's buckets: a copy of the gradients
            if mode in LOSSY or mode == "adasum":
                out.notes.append(f"data_parallel reduce {mode!r}: the all-reduce is counted "
                                 "uncompressed (an upper bound)")
    out.comm.update(out.micro_comm, times=k)
    out.comm.update(out.step_comm)
    out.comm.update(out.data_comm)
    return out


def task_parts(task: Any, model: str | None = None) -> tuple[Any, Any, Any]:
    """(model_fn, example, loss) of a built-in task's model (`bigbatch.tasks`): micro-batches
    shaped like its training data on meta, its own loss."""
    name = task.check_model(model)
    data = task.train_set.tensors

    def example(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.empty((micro, *t.shape[1:]), dtype=t.dtype, device="meta")
                     for t in data[:2])

    def loss(output: torch.Tensor, targets: torch.Tensor) -> Any:
        return task.loss(output, (None, targets))

    return (lambda: task.build_model(name)), example, loss


def plan_task(task: Any, strategy: Any, world: int, *, model: str | None = None,
              gpu_memory: float | None = None, probes: dict | None = None,
              ends_only: bool = False) -> LayoutPlan:
    """`plan` for a built-in task's model (`bigbatch.tasks`): its tensor-parallel plan and
    checks, its loss, micro-batches shaped like its training data. `probes`: as `_plan`."""
    from bigbatch.tasks import Task

    model_fn, example, loss = task_parts(task, model)
    return _plan(model_fn, strategy, world, example=example, loss=loss,
                 tp_plan_of=task.tp_plan, tp_given=type(task).tp_plan is not Task.tp_plan,
                 pipeline_layers=None, gpu_memory=gpu_memory,
                 check_tensor=task.check_tensor_parallel, probes=probes, ends_only=ends_only)
