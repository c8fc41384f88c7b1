"""The optimizer a Strategy names: torch's SGD / AdamW, or LARS / LAMB / Muon from
`bigbatch.optim`."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def _fast_kwargs(model: nn.Module) -> dict[str, bool]:
    """Fused kernels where torch has them for every parameter, else foreach.

    Fused SGD/AdamW run on CPU and CUDA and were the fastest on both when
    measured; they need floating-point parameters on one of those devices.
    """
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    # Sharded (DTensor) parameters take the foreach path, which DTensor dispatches per shard.
    if params and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                      and not isinstance(p, DTensor) for p in params):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(model: nn.Module, strategy: Any, lr: float | None = None,
                    zero: bool = False, *, data_degree: int | None = None,
                    replicas: Any = None) -> torch.optim.Optimizer:
    """The optimizer the strategy names, over `model`'s parameters, at learning rate `lr`:
    a plain `torch.optim.Optimizer` for any loop or trainer (`bigbatch.build_optimizer`).

    `strategy`: a `bigbatch.Strategy`, or a TOML file's path or text. momentum -> SGD,
    adamw -> AdamW (torch.optim, fused/foreach); `[lars]` turns momentum into LARS,
    `[lamb]` adamw into LAMB and `[muon]` adamw into Muon + AdamW (bigbatch.optim).
    Parameters are split by `exclusion_groups` (no weight decay and no trust ratio for
    the excluded, among them what the model's `no_weight_decay()` names, timm's
    convention). `lr` None: the strategy's peak LR (base LR scaled to its global batch
    over `data_degree` data-parallel ranks, default $WORLD_SIZE or 1), the LR a
    `bigbatch.ScheduleLR` over `strategy.schedule(...)` multiplies.
    `zero`: the same optimizer inside a `ZeroRedundancyOptimizer` (ZeRO stage 1).
    `replicas`: the process group whose ranks hold `model` whole and step it on the same
    gradients (`replica_group`): Muon splits its Newton-Schulz work between them
    (`bigbatch.Muon`'s ``replicas``); the other optimizers have no such work.
    """
    strategy = as_strategy(strategy)
    if lr is None:
        lr = _plan(strategy, data_degree).peak_lr
    cls, kwargs, exclude = _recipe(model, strategy, lr)
    if strategy.muon.enable:
        kwargs["replicas"] = replicas
    groups = _groups(model, strategy, kwargs.get("weight_decay", 0.0), exclude)
    if not zero:
        return cls(groups, **kwargs)
    from bigbatch.parallel.sharding import zero_optimizer

    return zero_optimizer(groups, cls, **kwargs)


def replica_group(strategy: Any, mesh: Any) -> Any:
    """The process group whose ranks hold every parameter whole (plain tensors) and step it
    on the same reduced gradient: DDP's data ranks, for `build_optimizer`'s `replicas`.
    None where there is none: one data rank; a mesh (FSDP2's and tensor parallelism's
    DTensors name their replicated dimensions themselves); ZeRO-1 (each rank steps its
    own partition); local SGD, the sync_switch policy and Adasum on deltas (each rank
    steps its own gradient). `mesh`: the run's `ParallelMesh`."""
    from bigbatch.config.comm import adasum_target, local_sgd_section

    deg = mesh.degrees
    if (not mesh.world.is_distributed or deg.needs_mesh or not deg.dp_enabled
            or deg.zero1_enabled or local_sgd_section(strategy) is not None
            or "sync_switch" in strategy.adaptive.policies
            or adasum_target(strategy) == "delta"):
        return None
    return mesh.dp_group


def as_strategy(strategy: Any) -> Any:
    """A `Strategy` as given, or read from a TOML path or text."""
    from bigbatch.config import Strategy

    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, (str, os.PathLike)):
        return Strategy.from_toml(strategy)
    raise TypeError(f"strategy={type(strategy).__name__}: expected a bigbatch.Strategy or "
                    "a TOML file's path or text")


def build_scheduler(optimizer: torch.optim.Optimizer, strategy: Any, total_steps: int, *,
                    data_degree: int | None = None, steps_per_epoch: int | None = None) -> Any:
    """The strategy's warmup and decay over `total_steps` optimizer steps as a
    `bigbatch.ScheduleLR` (a torch `LRScheduler`) on `optimizer`, built at the peak LR
    (`build_optimizer`'s default). It counts optimizer steps, not `step()` calls: a
    trainer that calls it once per process (Accelerate) cannot run it N times too fast."""
    from bigbatch.config.schedules import Schedule
    from bigbatch.optim.lr_scheduler import ScheduleLR

    strategy = as_strategy(strategy)
    schedule = Schedule.from_strategy(strategy, _plan(strategy, data_degree), total_steps,
                                      steps_per_epoch)
    return ScheduleLR(optimizer, schedule)


def _plan(strategy: Any, data_degree: int | None) -> Any:
    """The strategy's batch plan over `data_degree` data ranks (default: $WORLD_SIZE's
    data degree under the strategy's tensor and pipeline degrees, 1 without torchrun)."""
    if data_degree is None:
        from bigbatch.config.parallelism import degrees

        data_degree = degrees(strategy, int(os.environ.get("WORLD_SIZE", "1") or 1)).data
    return strategy.resolve(data_degree)


def weight_decays(model: nn.Module, strategy: Any) -> dict[int, float]:
    """The weight decay `build_optimizer` gives each trainable parameter, by `id`."""
    _, kwargs, exclude = _recipe(model, strategy, lr=0.0)
    groups = _groups(model, strategy, kwargs.get("weight_decay", 0.0), exclude, warn=False)
    return {id(p): float(g["weight_decay"]) for g in groups for p in g["params"]}


def _groups(model: nn.Module, strategy: Any, weight_decay: float,
            exclude: tuple[str, ...] | None, warn: bool = True) -> list[dict[str, Any]]:
    """`exclusion_groups`, or under [muon] its groups (`muon_param_groups`: Muon's matrices,
    AdamW's matrices named by muon.adamw_params, AdamW's undecayed tensors)."""
    if not strategy.muon.enable:
        groups = exclusion_groups(model, weight_decay, exclude, warn, _match(strategy))
        if strategy.lars.enable and not strategy.lars.adapt_without_weight_decay:
            for g in groups:  # Fleet's lars_momentum: no weight decay, no trust ratio
                g["layer_adaptation"] = g["layer_adaptation"] and g["weight_decay"] > 0
        return groups
    from bigbatch.optim import muon_param_groups

    return muon_param_groups(model, weight_decay, strategy.muon.adamw_params, exclude)


def exclusion_groups(model: nn.Module, weight_decay: float, exclude: tuple[str, ...] | None,
                     warn: bool = True, match: str = "substring") -> list[dict[str, Any]]:
    """Param groups: decayed, and excluded (weight decay 0, no trust ratio).

    `exclude` None: the default rule, every tensor with ndim <= 1 (biases, norm gains;
    nanoGPT's and timm's convention). A tuple: Fleet's rule, parameter-name substrings
    (`match` "suffix": name endings, Fleet's lamb). Under either, the names `model` or a
    submodule declares in `no_weight_decay()` (timm's ViT: `pos_embed`, `cls_token`);
    a pattern that matches no parameter gets a one-line warning naming it (`warn`).
    """
    from bigbatch.optim import declared_no_decay, param_groups

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for pattern in exclude if warn and exclude else ():
        if not any(pattern in name if match == "substring" else name.endswith(pattern)
                   for name, _ in named):
            log.warning("warning: exclude_from_weight_decay pattern %r matches no parameter "
                        "(names look like %r)", pattern, named[0][0] if named else "")
    return param_groups(named, weight_decay, exclude, match,
                        no_weight_decay=declared_no_decay(model))


def exclusion_summary(optimizer: torch.optim.Optimizer, group: Any = None,
                      skip: set[int] = frozenset()) -> str:
    """One line: how many tensors and parameters get weight decay (and a trust ratio) and
    how many are excluded, from the optimizer's param groups. `group`: the pipeline's process
    group, whose stages each hold a part of the model (collective: every stage calls it);
    `skip`: ids of parameters another stage counts (a tied weight's copies)."""
    counts = {True: [0, 0], False: [0, 0]}
    for g in optimizer.param_groups:
        kept = g.get("layer_adaptation", True)  # `exclusion_groups` marks the excluded
        for p in g["params"]:
            if id(p) in skip:
                continue
            counts[bool(kept)][0] += 1
            counts[bool(kept)][1] += p.numel()
    if group is not None:  # the whole model: every stage's tensors
        import torch.distributed as dist

        total = torch.tensor([*counts[True], *counts[False]], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=group)
        counts = {True: total[:2].tolist(), False: total[2:].tolist()}
    (dt, dp), (et, ep) = counts[True], counts[False]
    return (f"weight decay / trust ratio on {dt} tensors ({dp:,} parameters); excluded: "
            f"{et} tensors ({ep:,} parameters)")


def _recipe(model: nn.Module, strategy: Any, lr: float
            ) -> tuple[type, dict[str, Any], tuple[str, ...] | None]:
    """(optimizer class, its keyword arguments, exclude patterns or None for the ndim rule)."""
    # Strategy.__post_init__ has already rejected lars+lamb, mismatched types and double decay.
    o, lars, lamb = strategy.optimizer, strategy.lars, strategy.lamb
    if lars.enable:
        from bigbatch.optim import LARS

        return LARS, dict(
            lr=lr,
            momentum=o.momentum,
            weight_decay=lars.lars_weight_decay,
            trust_coefficient=lars.lars_coeff,
            eps=lars.epsilon,
            nesterov=strategy.nesterov,
            trust_clip=lars.trust_clip,
            always_adapt=lars.always_adapt,
        ), _patterns(lars.exclude_from_weight_decay)
    if lamb.enable:
        from bigbatch.optim import LAMB

        return LAMB, dict(
            lr=lr,
            betas=(o.beta1, o.beta2),
            eps=o.epsilon,
            weight_decay=lamb.lamb_weight_decay,
            trust_clip=lamb.trust_clip,
            always_adapt=lamb.always_adapt,
            bias_correction=lamb.bias_correction,
        ), _patterns(lamb.exclude_from_weight_decay)
    if strategy.muon.enable:
        from bigbatch.optim import Muon

        m = strategy.muon
        return Muon, dict(
            lr=lr, momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
            ns_coefficients=m.ns_coefficients, weight_decay=m.muon_weight_decay,
            scale_rule=m.scale_rule, update_rms=m.update_rms, betas=(o.beta1, o.beta2),
            eps=o.epsilon, spread_ns=m.spread_ns,
        ), _patterns(m.exclude_from_weight_decay)
    fast = _fast_kwargs(model)
    exclude = _patterns(getattr(o, "exclude_from_weight_decay", None))
    if o.type == "momentum":
        return torch.optim.SGD, dict(
            lr=lr,
            momentum=o.momentum,
            nesterov=strategy.nesterov,
            weight_decay=o.weight_decay,
            **fast,
        ), exclude
    return torch.optim.AdamW, dict(
        lr=lr,
        betas=(o.beta1, o.beta2),
        eps=o.epsilon,
        weight_decay=o.weight_decay,
        **fast,
    ), exclude


def _match(strategy: Any) -> str:
    """How the exclusion patterns in force match names (`exclude_match` of [lars]/[lamb])."""
    for section in (strategy.lars, strategy.lamb):
        if section.enable:
            return section.exclude_match
    return "substring"


def _patterns(exclude: Any) -> tuple[str, ...] | None:
    return None if exclude is None else tuple(exclude)
