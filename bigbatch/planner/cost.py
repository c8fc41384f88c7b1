"""What a step's operators cost: FLOPs from torch's own counter, bytes for the rest.

    cost = OpCost()
    with cost_counting(cost):
        ...                          # a forward and backward (or an optimizer step) on meta
    cost.seconds(device)             # the roofline time of those operators on `device`

`torch.utils.flop_counter.FlopCounterMode` knows the FLOPs of the operators that have
them (matrix products, convolutions, attention); it is subclassed here only to see each
operator once, with its arguments. Every operator is costed by the roofline of its own
kernel: ``max(flops / matmul rate of its dtype, bytes / memory bandwidth)`` plus the
device's launch overhead, where bytes are its tensor inputs and outputs. Views (an
output sharing an input's storage) cost nothing, nor do operators on 1-element host
tensors among device work (an optimizer's step counters: host bookkeeping, no kernel).
DTensor operators are costed on their local shards, what each rank runs. Fused kernels
touch fewer bytes than the op-by-op sum (an estimate on the high side for elementwise
chains).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    _FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from bigbatch.optim._norms import local

__all__ = ["OpCost", "cost_counting"]

aten = torch.ops.aten


@dataclass
class OpCost:
    """Operators of one piece of work, kept by kernel so any device can time them."""

    matmuls: list[tuple[str, float, float, float]] = field(default_factory=list)
    """(dtype name, FLOPs, bytes, attention work) of each operator with FLOPs; attention
    work is 0 for products, else the share of the counted FLOPs a fused attention kernel
    runs (1/2 when causal: torch's counter counts the whole score matrix)."""
    other_bytes: float = 0.0
    """Bytes read and written by the operators without FLOPs (elementwise, norms, copies)."""
    kernels: int = 0
    """Operators that launch a kernel (views left out)."""
    forward_flops: float = 0.0
    """FLOPs before the first backward operator: the model's forward (recompute excluded)."""

    @property
    def flops(self) -> float:
        return sum(entry[1] for entry in self.matmuls)

    def seconds(self, device: Any, times: float = 1.0) -> float:
        """Roofline time of these operators on `device` (`bigbatch.planner.devices.Device`),
        `times` over."""
        bw = device.memory_bandwidth * device.memory_efficiency
        t = 0.0
        for dtype, f, b, attention in self.matmuls:
            rate = (device.attention_rate(dtype) / attention if attention
                    else device.matmul_rate(dtype))
            t += max(f / rate, b / bw)
        t += self.other_bytes / bw + self.kernels * device.kernel_overhead
        return t * times

    def add(self, other: OpCost) -> None:
        self.matmuls += other.matmuls
        self.other_bytes += other.other_bytes
        self.kernels += other.kernels
        self.forward_flops += other.forward_flops


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _local_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return local(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local_tree(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _local_tree(v) for k, v in tree.items()}
    return tree


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _cpu_flash(query, key, value, *args, out_val=None, **kwargs) -> int:
    """The CPU flash kernel the meta probe runs in place of CUDA's: the same FLOPs."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_cpu_flash._get_raw = True  # take tensors, not shapes (FlopCounterMode's convention)
_cpu_flash_backward._get_raw = True

_EXTRA = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
          aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward}

def _causal(func_packet: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an attention operator masks causally (its ``is_causal`` argument)."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [a.name for a in func_packet.default._schema.arguments] \
        if hasattr(func_packet, "default") else []
    if "is_causal" in names:
        i = names.index("is_causal")
        return i < len(args) and bool(args[i])
    return False


# Operators that move nothing: bookkeeping, or collectives (timed by the link model);
# `profiler` is `record_function`'s markers around an optimizer's step (host only).
_FREE_NAMESPACES = ("_c10d_functional", "c10d", "prim", "profiler")
_FREE = {aten.detach, aten.alias, aten.lift_fresh}


def _host_scalars(tensors: list[torch.Tensor]) -> bool:
    """Host bookkeeping among device work: every tensor a 1-element one in host memory
    (torch's optimizers keep their step counters there and read each with ``.item()`` for
    the bias corrections: no kernel on the device). A plan's work is all on meta."""
    return bool(tensors) and all(t.device.type == "cpu" and t.numel() <= 1 for t in tensors)


class _Counter(FlopCounterMode):
    def __init__(self, cost: OpCost, backward_started: list[bool]) -> None:
        super().__init__(display=False, custom_mapping=_EXTRA)
        self.cost, self.backward_started = cost, backward_started

    # FlopCounterMode also tracks which module each FLOP belongs to, through hooks on
    # every module's forward and backward; only the operators are wanted here, and the
    # hooks cost as much as the counting on a large model: run the dispatch mode alone.
    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        mode, self.mode = self.mode, None
        return mode.__exit__(*args)

    def _count_flops(self, func_packet, out, args, kwargs):
        namespace = getattr(func_packet, "_qualified_op_name", str(func_packet)).split("::")[0]
        if namespace in _FREE_NAMESPACES or func_packet in _FREE:
            return out
        ins = [local(t) for t in _tensors((args, kwargs))]
        outs = [local(t) for t in _tensors(out)]
        if _host_scalars(ins + outs):
            return out
        storages = {_storage(t) for t in ins}
        fresh = [t for t in outs if _storage(t) not in storages]
        if outs and not fresh:
            return out  # a view or an in-place update's return: no new kernel by itself
        nbytes = float(sum(t.numel() * t.element_size() for t in ins + fresh))
        self.cost.kernels += 1
        if func_packet in self.flop_registry:
            flops = float(self.flop_registry[func_packet](
                *_local_tree(args), **_local_tree(kwargs), out_val=_local_tree(out)))
            dtype = (ins[0].dtype if ins else torch.float32)
            attention = 0.0
            if "attention" in str(func_packet):
                attention = 0.5 if _causal(func_packet, args, kwargs) else 1.0
            self.cost.matmuls.append((str(dtype).removeprefix("torch."), flops, nbytes,
                                      attention))
            if not self.backward_started[0]:
                self.cost.forward_flops += flops
        else:
            self.cost.other_bytes += nbytes
        return out


@contextlib.contextmanager
def cost_counting(cost: OpCost) -> Iterator[list[bool]]:
    """Cost every operator run inside into `cost`. Yields a one-item list: set its item to
    True when the backward starts (FLOPs before it are the forward's)."""
    flag = [False]
    with _Counter(cost, flag):
        yield flag
