"""One micro-batch through one rank's part of the model on the meta device: the activations
backward will need, and the tensor-parallel traffic of its forward and backward.

Meta tensors carry shapes and dtypes and no data, so this costs milliseconds for a model
of any size. What is measured, and why it is an estimate:

- activations: the distinct storages autograd saves for backward (a
  `saved_tensors_hooks` pack), parameters and buffers left out, plus the inputs a
  recomputed module keeps. Attention is counted as a fused kernel keeps it on a GPU
  (q, k, v, output and the log-sum-exp: no ``t x t`` matrix). Under `[amp]` the forward
  follows autocast's casts (matrix products in the low dtype, norms, softmax and losses
  in float32), so saved tensors have the dtypes a GPU run gives them, and autocast's
  low-dtype weight copies count. Not counted: the allocator's rounding and
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
from bigbatch.planner.cost import OpCost, cost_counting
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
    cost: OpCost = field(default_factory=OpCost)
    """Its operators, forward and backward (`bigbatch.planner.cost`): what the time model
    costs on a device."""


# Autocast's lists (torch.amp): what runs in the low dtype, and what in float32.
_LOW = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
        torch.Tensor.matmul, torch.Tensor.__matmul__, F.conv1d, F.conv2d, F.conv3d,
        F.scaled_dot_product_attention}
_FLOAT32 = {F.layer_norm, F.group_norm, F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss,
            F.mse_loss, torch.Tensor.softmax, torch.Tensor.log_softmax}


class _GpuOps(TorchFunctionMode):
    """The meta forward as a GPU runs it: `scaled_dot_product_attention` as the fused
    kernel (the meta device would take the math path, which keeps the whole attention
    matrix), and under `[amp]` autocast's casts (meta tensors have no autocast): matrix
    products in the low dtype, norms, softmax and losses in float32. A weight's low-dtype
    copy is autocast's cache, kept for backward; `weight_copies` collects their storages
    (with FSDP's mixed precision they are the gathered parameters instead)."""

    def __init__(self, amp_dtype: torch.dtype | None, params: set[int]) -> None:
        super().__init__()
        self.amp_dtype, self.params = amp_dtype, params
        self.weight_copies: set[int] = set()

    def _cast(self, value, dtype: torch.dtype):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            out = value.to(dtype)
            if local(value).untyped_storage()._cdata in self.params:
                self.weight_copies.add(local(out).untyped_storage()._cdata)
            return out
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.amp_dtype is not None and (func in _LOW or func in _FLOAT32):
            dtype = self.amp_dtype if func in _LOW else torch.float32
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
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

    def __init__(self, *skip: set[int]) -> None:
        self.skip, self.seen, self.total = skip, set(), 0

    def add(self, t: torch.Tensor) -> None:
        t = local(t)
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.seen or any(key in s for s in self.skip):
            return
        self.seen.add(key)
        self.total += storage.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t


def _storages(module: nn.Module) -> set[int]:
    return {local(t).untyped_storage()._cdata
            for t in [*module.parameters(), *module.buffers()]}


def nbytes(t: torch.Tensor) -> int:
    """Bytes of `t` (its local shard)."""
    t = local(t)
    return t.numel() * t.element_size()


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


@contextlib.contextmanager
def _recompute_like_forward(ops: _GpuOps) -> Iterator[None]:
    """Run `torch.utils.checkpoint`'s recomputation under the forward's `_GpuOps` too:
    backward does not carry torch-function modes, so a recomputed attention would take the
    meta device's math path and fail checkpoint's check that it recomputed the same
    tensors. Its ``context_fn`` default is swapped for the duration (the engine's
    recompute passes none)."""
    from torch.utils import checkpoint as ckpt

    target = getattr(ckpt.checkpoint, "__wrapped__", ckpt.checkpoint)
    defaults = target.__kwdefaults__
    if not defaults or "context_fn" not in defaults:
        yield
        return
    saved = defaults["context_fn"]

    def context_fn():
        again = _GpuOps(ops.amp_dtype, ops.params)
        again.weight_copies = ops.weight_copies
        return contextlib.nullcontext(), again

    defaults["context_fn"] = context_fn
    try:
        yield
    finally:
        defaults["context_fn"] = saved


def probe(module: nn.Module, stages: Sequence[StageRun],
          names: dict[str, str], *, loss: Callable | None, targets: torch.Tensor | None,
          amp_dtype: torch.dtype | None = None, gathered_weights: bool = False,
          recomputed: Sequence[str] = (),
          loss_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> Probe:
    """Run one micro-batch through `stages` (this rank's, in order) forward and backward; `loss(output, targets)` (a tensor, or ``(sum, count)``) on
    the last stage, else a gradient of ones. `names`: process groups to mesh dimensions.
    `amp_dtype`: autocast's; `gathered_weights`: FSDP's mixed precision gathers the
    low-dtype weights (its buffers, not activations)."""
    out = Probe()
    params = _storages(module)
    ops = _GpuOps(amp_dtype, params)
    # With FSDP's mixed precision the low-dtype weights are its gathered parameters.
    saved = _Saved(params, ops.weight_copies) if gathered_weights else _Saved(params)
    ctx = loss_context() if loss_context is not None else contextlib.nullcontext()
    with counting(out.comm, names), ops, _HostReads(), ctx, \
            _recompute_inputs(module, recomputed, saved), _recompute_like_forward(ops), \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
            cost_counting(out.cost) as backward:
        for stage in stages:
            backward[0] = False
            x = stage.input
            if not stage.first:  # what a stage receives is a leaf that wants its gradient
                x = x.detach().requires_grad_(True)
            y = stage.run(x)
            out.received.append(0 if stage.first else nbytes(x))
            out.sent.append(0 if stage.last else nbytes(y))
            if stage.last and loss is not None and targets is not None:
                value = loss(y, targets)
                value = value[0] if isinstance(value, tuple) else value
                backward[0] = True
                value.backward()
            else:
                backward[0] = True
                torch.autograd.backward(y, torch.ones_like(y))
    out.activations = saved.total
    for p in module.parameters():
        p.grad = None
    return out
