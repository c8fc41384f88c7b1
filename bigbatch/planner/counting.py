"""Counting what a step hands to torch.distributed: bytes by collective and mesh dimension.

    count = CommCount()
    with counting(count, dims_of(mesh)):
        ...                     # forward, backward, optimizer step
    count.bytes                 # {"all_reduce": {"dp": 1234, ...}, ...}

Two routes are watched. Calls through `torch.distributed` (FSDP2's all-gathers and
reduce-scatters, DDP's comm hooks, ZeRO's broadcasts, the optimizers' norm all-reduces,
Muon's all-to-alls of whole matrices, the pipeline's sends) are wrapped for the duration;
DTensor's functional collectives (tensor parallelism, Muon's gathers of 2-D sharded
matrices) are seen by a dispatch mode. The size of a collective is the size of its buffer:
an all-gather's output, a reduce-scatter's input, an all-reduce's or a broadcast's tensor,
an all-to-all's input (what this rank sends, its own share included), a send's tensor
(receives are the peer's sends and not counted). Groups of one rank move nothing and are
left out.

`bigbatch plan` counts its meta-device steps with this; the tests count real gloo runs
with it, so the two speak the same units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KINDS", "CommCount", "counting", "dims_of", "wire_bytes"]

GIB = 2**30

ACTIVATION_METHOD = (
    "measured on the meta device: the storages autograd saves for backward in one "
    "micro-batch's forward (parameters excluded; attention counted as a fused kernel keeps "
    "it; under amp, autocast's casts and weight copies), times the micro-batches in flight; "
    "an estimate: no allocator rounding, per-operator temporaries or library workspaces")

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all",
         "point_to_point")
"""Collective kinds, in the order reports list them."""


class CommCount:
    """Bytes and calls per (collective kind, mesh dimension), and each dimension's size."""

    def __init__(self) -> None:
        self.bytes: dict[str, dict[str, int]] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self.sizes: dict[str, int] = {}
        """Ranks in each dimension's group (what the ring model of `wire_bytes` needs)."""

    def add(self, kind: str, dim: str, nbytes: int, size: int, calls: int = 1) -> None:
        if size <= 1 or nbytes <= 0:
            return
        self.bytes.setdefault(kind, {})
        self.calls.setdefault(kind, {})
        self.bytes[kind][dim] = self.bytes[kind].get(dim, 0) + int(nbytes)
        self.calls[kind][dim] = self.calls[kind].get(dim, 0) + int(calls)
        self.sizes[dim] = size

    def update(self, other: CommCount, times: int = 1) -> None:
        """Add `other`'s counts, `times` over (a micro-batch's collectives, k per step)."""
        for kind, dims in other.bytes.items():
            for dim, nbytes in dims.items():
                self.add(kind, dim, nbytes * times, other.sizes[dim],
                         other.calls[kind][dim] * times)

    def total(self) -> int:
        return sum(n for dims in self.bytes.values() for n in dims.values())

    def to_dict(self) -> dict[str, dict[str, int]]:
        """{kind: {dim: bytes}} in `KINDS` order, kinds with nothing left out."""
        return {k: dict(sorted(self.bytes[k].items())) for k in KINDS if k in self.bytes}


def wire_bytes(count: CommCount) -> int:
    """Bytes one rank sends for these collectives under ring algorithms: an all-reduce of S
    bytes over n ranks sends 2(n-1)/n S, an all-gather (S its output) or reduce-scatter (S its
    input) (n-1)/n S, a broadcast (n-1)/n S on average over the ranks, a send S."""
    total = 0.0
    for kind, dims in count.bytes.items():
        for dim, nbytes in dims.items():
            n = count.sizes[dim]
            factor = (1.0 if kind == "point_to_point" else
                      2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n)
            total += factor * nbytes
    return int(round(total))


def dims_of(mesh: Any) -> dict[str, str]:
    """Process group name -> the mesh dimension it spans, for a `ParallelMesh` (or None):
    ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``, ``dp`` (the data ranks together) and
    ``world`` (the default group)."""
    names: dict[str, str] = {}
    if dist.is_initialized():
        names[dist.group.WORLD.group_name] = "world"
    device_mesh = getattr(mesh, "device_mesh", None)
    if device_mesh is not None:
        for dim in device_mesh.mesh_dim_names:
            names[device_mesh[dim].get_group().group_name] = dim
        dp = getattr(mesh, "_dp", None)
        if dp is not None:
            names.setdefault(dp.get_group().group_name, "dp")
    if "world" in names.values() and device_mesh is None:
        # Without a mesh the data ranks are the default group.
        names[dist.group.WORLD.group_name] = "dp"
    return names


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


class _Watch:
    def __init__(self, count: CommCount, names: dict[str, str]) -> None:
        self.count, self.names = count, names

    def add(self, kind: str, group: Any, nbytes: int) -> None:
        group = _group(group)
        self.count.add(kind, self.names.get(group.group_name, "other"), nbytes, group.size())

    def add_named(self, kind: str, group_name: str, nbytes: int) -> None:
        group = c10d._resolve_process_group(group_name)
        self.count.add(kind, self.names.get(group_name, "other"), nbytes, group.size())


class _Functional(TorchDispatchMode):
    """Sees DTensor's functional collectives (`_c10d_functional` ops)."""

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "_c10d_functional":
            self._record(name.rstrip("_"), args)
        return func(*args, **kwargs)

    def _record(self, name: str, args: tuple) -> None:
        if name == "all_reduce":
            self.watch.add_named("all_reduce", args[2], _nbytes(args[0]))
        elif name == "all_reduce_coalesced":
            self.watch.add_named("all_reduce", args[2], sum(_nbytes(t) for t in args[0]))
        elif name == "all_gather_into_tensor":
            self.watch.add_named("all_gather", args[2], _nbytes(args[0]) * int(args[1]))
        elif name == "all_gather_into_tensor_coalesced":
            self.watch.add_named("all_gather", args[2],
                                 sum(_nbytes(t) for t in args[0]) * int(args[1]))
        elif name == "reduce_scatter_tensor":
            self.watch.add_named("reduce_scatter", args[3], _nbytes(args[0]))
        elif name == "reduce_scatter_tensor_coalesced":
            self.watch.add_named("reduce_scatter", args[3], sum(_nbytes(t) for t in args[0]))
        elif name == "all_to_all_single":
            self.watch.add_named("all_to_all", args[3], _nbytes(args[0]))
        elif name == "broadcast":
            self.watch.add_named("broadcast", args[2], _nbytes(args[0]))


def _wrapped(watch: _Watch) -> dict[str, Any]:
    """Replacements for the torch.distributed functions the engine's parts call."""
    # `all_gather_single` / `reduce_scatter_single` are new in torch 2.13 (FSDP2 calls them).
    original = {name: getattr(dist, name, None) for name in (
        "all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single",
        "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "isend",
        "send")}

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        watch.add("all_reduce", group, _nbytes(tensor))
        return original["all_reduce"](tensor, op=op, group=group, async_op=async_op)

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        watch.add("broadcast", group, _nbytes(tensor))
        return original["broadcast"](tensor, src=src, group=group, async_op=async_op,
                                     group_src=group_src)

    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        watch.add("all_gather", group, _nbytes(output_tensor))
        return original["all_gather_single"](output_tensor, input_tensor, group=group,
                                             async_op=async_op)

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        watch.add("all_gather", group, _nbytes(output_tensor))
        return original["all_gather_into_tensor"](output_tensor, input_tensor, group=group,
                                                  async_op=async_op)

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None,
                              async_op=False):
        watch.add("reduce_scatter", group, _nbytes(input))
        return original["reduce_scatter_single"](output, input, op=op, group=group,
                                                 async_op=async_op)

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None,
                              async_op=False):
        watch.add("reduce_scatter", group, _nbytes(input))
        return original["reduce_scatter_tensor"](output, input, op=op, group=group,
                                                 async_op=async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        watch.add("all_to_all", group, _nbytes(input))
        return original["all_to_all_single"](output, input, output_split_sizes,
                                             input_split_sizes, group=group, async_op=async_op)

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        watch.add("point_to_point", group, _nbytes(tensor))
        return original["isend"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        watch.add("point_to_point", group, _nbytes(tensor))
        return original["send"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

    wrapped = {"all_reduce": all_reduce, "broadcast": broadcast,
               "all_gather_single": all_gather_single,
               "all_gather_into_tensor": all_gather_into_tensor,
               "reduce_scatter_single": reduce_scatter_single,
               "reduce_scatter_tensor": reduce_scatter_tensor,
               "all_to_all_single": all_to_all_single, "isend": isend, "send": send}
    return {name: fn for name, fn in wrapped.items() if original[name] is not None}


# Where each wrapped function is looked up at call time: `torch.distributed` for the
# engine, FSDP2, DDP's hooks and ZeRO; the c10d module too for the point-to-point ops,
# which `P2POp` checks by identity and `batch_isend_irecv` calls from there.
_ALSO_IN_C10D = ("isend", "send")


@contextlib.contextmanager
def counting(count: CommCount, names: dict[str, str]) -> Iterator[CommCount]:
    """Count into `count` every collective started inside (see the module docstring);
    `names` maps process group names to mesh dimensions (`dims_of`)."""
    watch = _Watch(count, names)
    replacements = _wrapped(watch)
    saved = {name: getattr(dist, name) for name in replacements}
    saved_c10d = {name: getattr(c10d, name) for name in _ALSO_IN_C10D}
    try:
        for name, fn in replacements.items():
            setattr(dist, name, fn)
        for name in _ALSO_IN_C10D:
            setattr(c10d, name, replacements[name])
        with _Functional(watch):
            yield count
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        for name, fn in saved_c10d.items():
            setattr(c10d, name, fn)
