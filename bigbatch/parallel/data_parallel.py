"""Data parallelism: DistributedDataParallel around the model, and the engine's comm hook.

The hook wraps the reduction that actually combines gradients (DDP's all-reduce
mean, or Adasum) and, when the noise scale needs it, measures each worker's
gradient norm on the bucket before it is reduced. It is the only code here that
runs per step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bigbatch.errors import ConfigError

__all__ = ["CommState", "DataParallel", "UnusedParametersError", "check_reduce", "reducer_names",
           "unused_parameters_line", "wrap_data_parallel"]


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

    def state_dict(self) -> dict[str, Any] | None:
        """This worker's memory of the inner hook (error feedback, local SGD's counters), or
        None when it keeps none; ``kind`` names the hook state it belongs to."""
        inner = self.inner_state
        if hasattr(inner, "state_dict"):
            return {"inner": inner.state_dict(), "kind": type(inner).__name__}
        from bigbatch.parallel.compression import hook_state_dict

        saved = hook_state_dict(inner)
        return None if saved is None else {**saved, "kind": type(inner).__name__}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`; the memory of another reduce (a resume that switched it)
        is left out and the hook starts afresh, as on another world size."""
        if state.get("kind", type(self.inner_state).__name__) != type(self.inner_state).__name__:
            return
        if "inner" in state:
            self.inner_state.load_state_dict(state["inner"])
        else:
            from bigbatch.parallel.compression import load_hook_state

            load_hook_state(self.inner_state, state)


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
    from bigbatch.config.sections import REDUCES

    if reduce not in REDUCES:
        raise ConfigError(f"data_parallel.reduce={reduce!r}: expected one of {', '.join(REDUCES)}")
    if reduce == "adasum":
        _adasum_hook()


class UnusedParametersError(RuntimeError):
    """A step left parameters without a gradient on a worker, and DDP was not told to
    expect it (`data_parallel.find_unused_parameters`)."""


_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_INDICES = "Parameter indices which did not receive grad for rank "


def reducer_names(module: nn.Module) -> list[str]:
    """The names of `module`'s parameters in the order DDP's reducer numbers them: by
    module, those that require grad, a shared one once."""
    seen, names = set(), []
    for prefix, sub in module.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            if p.requires_grad and p not in seen:
                seen.add(p)
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def unused_parameters_line(module: nn.Module, text: str) -> str | None:
    """One line for DDP's "did not receive grad" error (its parameters by name), else None."""
    if _UNFINISHED not in text:
        return None
    rank, names = "?", []
    if _INDICES in text:
        rank, _, rest = text.split(_INDICES, 1)[1].partition(":")
        order = reducer_names(module)
        for tok in rest.strip().splitlines()[0].split() if rest.strip() else []:
            if tok.isdigit() and int(tok) < len(order):
                names.append(order[int(tok)])
    which = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    what = f"parameter(s) {which}" if names else "some parameters"
    return (f"{what} got no gradient on rank {rank.strip()} in a step (a part of the model "
            "that worker did not use): --set data_parallel.find_unused_parameters=true lets "
            "DDP expect it, or use every parameter in forward")


class DataParallel(DistributedDataParallel):
    """DDP whose error for parameters without a gradient names them (torch's gives their
    indices unless TORCH_DISTRIBUTED_DEBUG is set)."""

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            line = unused_parameters_line(self.module, str(e))
            if line is None:
                raise
            raise UnusedParametersError(line) from None


def wrap_data_parallel(
    model: nn.Module, device: torch.device, dp: Any, measure_local: bool,
    inner: tuple[Callable, Any] | None = None,
) -> tuple[nn.Module, CommState | None]:
    """DistributedDataParallel around `model`, plus our comm hook when one is needed.

    `inner`: the (hook, state) that combines gradients instead of the mean (a compressed
    reduce, local SGD's); Adasum comes from `dp.reduce`. Without either, or local-norm
    measurement, DDP keeps its built-in C++ all-reduce, the fastest path; otherwise one
    Python hook wraps the inner one.
    """
    ddp = DataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=float(dp.bucket_cap_mb),
        find_unused_parameters=bool(getattr(dp, "find_unused_parameters", False)),
    )
    reduce = getattr(dp, "reduce", "mean")
    if inner is None and reduce == "mean" and not measure_local:
        return ddp, None
    if inner is not None:
        inner, inner_state = inner
    elif reduce == "adasum":
        inner, inner_state = _adasum_hook()
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner, inner_state = allreduce_hook, None
    state = CommState(inner, inner_state, measure_local)
    ddp.register_comm_hook(state, _engine_comm_hook)
    return ddp, state
