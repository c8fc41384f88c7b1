"""One micro-batch through one rank's part of the model on the meta device: the activations
backward will need, and the tensor-parallel traffic of its forward and backward.

Meta tensors carry shapes and dtypes and no data, so this costs milliseconds for a model
of any size. What is measured, and why it is an estimate:

- activations: the distinct storages autograd saves for backward (a
  `saved_tensors_hooks` pack), parameters and buffers left out, plus the inputs a
  recomputed module keeps. Attention is counted as a fused kernel keeps it on a GPU
  (q, k, v, output and the log-sum-exp: no ``t x t`` matrix). Under `[amp]` floating
  tensors count at the autocast dtype's size. Not counted: the allocator's rounding and
  fragmentation, temporaries that die inside one operator, cuBLAS/NCCL workspaces.
- traffic: DTensor's collectives as they are issued (`bigbatch.planner.counting`), the
  loss included; the same count a real run gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from bigbatch.optim._norms import local
from bigbatch.planner.counting import CommCount, counting

__all__ = ["Probe", "StageRun", "nbytes", "probe"]


@dataclass(frozen=True)
class StageRun:
    """One pipeline stage of this rank (the whole model without a pipeline)."""

    run: Callable[[torch.Tensor], torch.Tensor]
    """Its forward: input to output."""
    input: torch.Tensor
    """One micro-batch's input (meta): the data for the first stage, else the activation
    the previous stage sends."""
    first: bool
    last: bool


@dataclass
class Probe:
    """What one micro-batch costs this rank."""

    activations: int = 0
    """Bytes kept for backward (see the module docstring)."""
    comm: CommCount = field(default_factory=CommCount)
    """Tensor-parallel collectives of its forward and backward (and the loss)."""
    sent: list[int] = field(default_factory=list)
    """Bytes of each stage's output (what it sends to the next stage), per stage."""
    received: list[int] = field(default_factory=list)
    """Bytes of each stage's input from the previous stage (its gradient goes back), per
    stage; 0 for the first stage."""


class _FusedAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` as the fused kernel GPUs run (the meta device would
    take the math path, which keeps the whole attention matrix)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _fused(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False):
    if attn_mask is not None or enable_gqa or query.shape != key.shape:
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale)[0]


class _HostReads(TorchDispatchMode):
    """A meta tensor read to the host (a loss's item count, ``int(mask.sum())``) reads 1:
    there is no value, and a count only scales the loss."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return 1 if not args[0].is_floating_point() else 1.0
        return func(*args, **(kwargs or {}))


class _Saved:
    """Sums the bytes of distinct storages saved for backward."""

    def __init__(self, skip: set[int], itemsize: int | None) -> None:
        self.skip, self.seen, self.total = skip, set(), 0
        self.itemsize = itemsize

    def add(self, t: torch.Tensor) -> None:
        t = local(t)
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.skip or key in self.seen:
            return
        self.seen.add(key)
        nbytes = storage.nbytes()
        if self.itemsize is not None and t.is_floating_point() and t.element_size() > self.itemsize:
            nbytes = nbytes * self.itemsize // t.element_size()
        self.total += nbytes

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t


def _storages(module: nn.Module) -> set[int]:
    return {local(t).untyped_storage()._cdata
            for t in [*module.parameters(), *module.buffers()]}


def nbytes(t: torch.Tensor, itemsize: int | None = None) -> int:
    """Bytes of `t` (its local shard), floating tensors at `itemsize` when given (amp)."""
    t = local(t)
    size = t.element_size()
    if itemsize is not None and t.is_floating_point():
        size = min(size, itemsize)
    return t.numel() * size


@contextlib.contextmanager
def _recompute_inputs(module: nn.Module, names: Sequence[str], saved: _Saved) -> Iterator[None]:
    """A recomputed module keeps its inputs instead of its activations: count them."""
    def keep_inputs(_module: nn.Module, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                saved.add(a)

    present = dict(module.named_modules())
    handles = [present[name].register_forward_pre_hook(keep_inputs)
               for name in names if name in present]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def probe(module: nn.Module, stages: Sequence[StageRun],
          names: dict[str, str], *, loss: Callable | None, targets: torch.Tensor | None,
          amp_itemsize: int | None = None, recomputed: Sequence[str] = (),
          loss_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> Probe:
    """Run one micro-batch through `stages` (this rank's, in order) forward and backward; `loss(output, targets)` (a tensor, or ``(sum, count)``) on
    the last stage, else a gradient of ones. `names`: process groups to mesh dimensions."""
    out = Probe()
    saved = _Saved(_storages(module), amp_itemsize)
    ctx = loss_context() if loss_context is not None else contextlib.nullcontext()
    with counting(out.comm, names), _FusedAttention(), _HostReads(), ctx, \
            _recompute_inputs(module, recomputed, saved), \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        for stage in stages:
            x = stage.input
            if not stage.first:  # what a stage receives is a leaf that wants its gradient
                x = x.detach().requires_grad_(True)
            y = stage.run(x)
            out.received.append(0 if stage.first else nbytes(x, amp_itemsize))
            out.sent.append(0 if stage.last else nbytes(y, amp_itemsize))
            if stage.last and loss is not None and targets is not None:
                value = loss(y, targets)
                value = value[0] if isinstance(value, tuple) else value
                value.backward()
            else:
                torch.autograd.backward(y, torch.ones_like(y))
    out.activations = saved.total
    for p in module.parameters():
        p.grad = None
    return out
