"""Pieces `prepare()` assembles: the optimizer, recompute, DDP and its comm hook.

Kept apart from `engine.py` so the per-step code there stays short; nothing
here runs per step except `_engine_comm_hook`.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bigbatch.errors import ConfigError

# ---------------------------------------------------------------- optimizer


def _fast_kwargs(model: nn.Module) -> dict[str, bool]:
    """Fused kernels where torch has them for every parameter, else foreach.

    Fused SGD/AdamW run on CPU and CUDA and were the fastest on both when
    measured; they need floating-point parameters on one of those devices.
    """
    params = list(model.parameters())
    if params and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(model: nn.Module, strategy: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer the strategy names, over `model`'s parameters, at learning rate `lr`.

    momentum -> SGD, adamw -> AdamW (torch.optim, fused/foreach); `[lars]` turns
    momentum into LARS and `[lamb]` adamw into LAMB (bigbatch.optim), which get
    `named_parameters()` so `exclude_from_weight_decay` can match names.
    """
    # Strategy.__post_init__ has already rejected lars+lamb, mismatched types and double decay.
    o, lars, lamb = strategy.optimizer, strategy.lars, strategy.lamb
    if lars.enable:
        from bigbatch.optim import LARS

        return LARS(
            list(model.named_parameters()),
            lr=lr,
            momentum=o.momentum,
            weight_decay=lars.lars_weight_decay,
            trust_coefficient=lars.lars_coeff,
            eps=lars.epsilon,
            nesterov=o.nesterov,
            exclude=tuple(lars.exclude_from_weight_decay),
            trust_clip=lars.trust_clip,
            always_adapt=lars.always_adapt,
        )
    if lamb.enable:
        from bigbatch.optim import LAMB

        return LAMB(
            list(model.named_parameters()),
            lr=lr,
            betas=(o.beta1, o.beta2),
            eps=o.epsilon,
            weight_decay=lamb.lamb_weight_decay,
            exclude=tuple(lamb.exclude_from_weight_decay),
            max_grad_norm=lamb.max_grad_norm,
            trust_clip=lamb.trust_clip,
            always_adapt=lamb.always_adapt,
        )
    fast = _fast_kwargs(model)
    if o.type == "momentum":
        return torch.optim.SGD(
            model.parameters(),
            lr=lr,
            momentum=o.momentum,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay,
            **fast,
        )
    return torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        betas=(o.beta1, o.beta2),
        eps=o.epsilon,
        weight_decay=o.weight_decay,
        **fast,
    )


# ---------------------------------------------------------------- recompute


class _Recomputed:
    """A module's forward run under `torch.utils.checkpoint` (non-reentrant).

    Installed as the *instance* attribute `forward`, so parameter names and
    state_dict keys stay exactly those of the user's model. It holds the module
    itself (not a bound method) so `copy.deepcopy` and pickling follow the copy.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, names: list[str]) -> list[str]:
    """Make the named submodules recompute their activations in backward.

    Unknown names are a ConfigError that lists the closest existing names.
    Returns the names wrapped.
    """
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules or name == "":
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(
                f"recompute.checkpoints: no module named {name!r} in the model{hint} "
                "(names as in model.named_modules())"
            )
    for name in names:
        module = modules[name]
        if not isinstance(module.__dict__.get("forward"), _Recomputed):
            module.forward = _Recomputed(module)
    return list(names)


# ---------------------------------------------------------------- data parallel


class CommState:
    """State of the engine's DDP comm hook: the inner hook and what it measures."""

    def __init__(self, inner: Callable, inner_state: Any, measure_local: bool) -> None:
        self.inner = inner
        """The hook that actually combines gradients (all-reduce mean or Adasum)."""
        self.inner_state = inner_state
        self.measure_local = measure_local
        """Sum the squared norm of each bucket before it is reduced."""
        self.local_sq: torch.Tensor | None = None
        """Squared norm of this worker's gradient since the last reset (still loss-scaled)."""
        self.calls = 0
        """Buckets reduced so far (one collective each)."""

    def take_local_sq(self) -> torch.Tensor | None:
        value, self.local_sq = self.local_sq, None
        return value


def _engine_comm_hook(state, bucket):  # DDP inspects annotations; postponed ones fail its check
    state.calls += 1
    if state.measure_local:
        # One scalar per bucket, taken before the inner hook divides or reduces in place.
        sq = torch.linalg.vector_norm(bucket.buffer()).square()
        state.local_sq = sq if state.local_sq is None else state.local_sq + sq
    return state.inner(state.inner_state, bucket)


def _adasum_hook() -> tuple[Callable, Any]:
    try:
        adasum = importlib.import_module("bigbatch.adaptive.adasum")
    except ImportError:
        raise ConfigError(
            "data_parallel.reduce='adasum' needs bigbatch.adaptive.adasum, which is not available; "
            "use reduce='mean'"
        ) from None
    hook = getattr(adasum, "adasum_hook", None)
    if hook is None:
        raise ConfigError("data_parallel.reduce='adasum': bigbatch.adaptive.adasum has no adasum_hook")
    return hook, None


def check_reduce(reduce: str) -> None:
    """Validate `data_parallel.reduce` early, before any process group exists."""
    if reduce not in ("mean", "adasum"):
        raise ConfigError(f"data_parallel.reduce={reduce!r}: expected one of mean, adasum")
    if reduce == "adasum":
        _adasum_hook()


def wrap_data_parallel(
    model: nn.Module, device: torch.device, dp: Any, measure_local: bool
) -> tuple[nn.Module, CommState | None]:
    """DistributedDataParallel around `model`, plus our comm hook when one is needed.

    Without Adasum or local-norm measurement DDP keeps its built-in C++
    all-reduce, the fastest path; otherwise one Python hook wraps the inner one.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=float(dp.bucket_cap_mb),
    )
    reduce = getattr(dp, "reduce", "mean")
    if reduce == "mean" and not measure_local:
        return ddp, None
    if reduce == "adasum":
        inner, inner_state = _adasum_hook()
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner, inner_state = allreduce_hook, None
    state = CommState(inner, inner_state, measure_local)
    ddp.register_comm_hook(state, _engine_comm_hook)
    return ddp, state
