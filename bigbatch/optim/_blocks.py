"""Cache-sized blocks of tensors and their norms, for the per-tensor (CPU) kernels.

A layer-wise step reads every tensor twice: once for the norms that set its
rate, once for the update that rate scales. Norms of *all* tensors first and
updates after stream the whole model from memory twice. Taken a block at a
time (consecutive tensors, at most ``BLOCK`` elements, or one larger tensor),
the update finds the block still in cache. On ResNet-50 shapes (2 threads,
32 MiB L3) this made LARS's norms + fused SGD about 25 % faster than the
all-norms-first order.

Per block the norms come back as one 1-d tensor, so the trust-ratio rules of
``_steps.py`` run once per block on stacked norms (a handful of ops, not a
handful per tensor), and the results reach the host in one ``tolist()``:
a host read costs nothing on CPU, and the fused kernels take Python floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ._base import dense
from ._norms import sum_over_shards

# Elements per block: w, g and a state tensor (LARS), or w, u and the chunk
# traffic of LAMB's first pass, of 1 M fp32 elements stay well inside a shared
# 32 MiB L3, while the per-block ops (stack, rule, tolist) stay negligible.
BLOCK = 1 << 20

# Below this many elements a tensor's step costs dispatch (a few microseconds a
# call), not memory time: LAMB steps such tensors a block at a time with
# multi-tensor calls rather than one fused call each (``_lamb_cpu``).
SMALL = 1 << 15


def blocks(tensors: list[torch.Tensor], size: int | None = None) -> Iterator[list[int]]:
    """Indices of consecutive runs of ``tensors`` of one (device, dtype), at most
    ``size`` (default ``BLOCK``) elements each; a larger tensor is a run by itself."""
    size = BLOCK if size is None else size
    run: list[int] = []
    total = 0
    kind = None
    for i, t in enumerate(tensors):
        n = t.numel()
        if run and (total + n > size or (t.device, t.dtype) != kind):
            yield run
            run, total = [], 0
        run.append(i)
        total += n
        kind = (t.device, t.dtype)
    if run:
        yield run


# Below this many elements a tensor's norm is mostly dispatch: those of a block
# go through one ``torch._foreach_norm`` call instead of a reduction each.
DOT_MIN = 1 << 15


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor as 1-d in memory order (a view)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a tensor as a 0-d tensor: a BLAS dot over its memory
    when dense (see ``host_norms``), else the norm reduction squared."""
    if dense(t):
        flat = memory_order(t)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(t).square()


def whole_squares(shards: list[torch.Tensor], owners: list[torch.Tensor]) -> list[float]:
    """Squared norms of whole tensors from their local shards (``shards[i]`` laid
    out like the DTensor ``owners[i]``), as Python floats: the shards' squares
    by ``squared_norm``, summed over the meshes in one collective per (mesh,
    dims) (``_norms.sum_over_shards``), read to the host once."""
    if not shards:
        return []
    squares = [squared_norm(t) for t in shards]
    if len({s.dtype for s in squares}) > 1:
        squares = [s.double() for s in squares]
    return sum_over_shards(torch.stack(squares), owners).tolist()


def host_norms(tensors: list[torch.Tensor], extra: list[torch.Tensor] = ()
               ) -> tuple[list[float], list[float]]:
    """L2 norm of each tensor as Python floats, and the values of the 0-d
    tensors ``extra``, read to the host together (all of one dtype).

    A large dense tensor's squared norm is a BLAS dot product over its memory
    (on CPU about 20 % faster than torch's norm reduction, and in float32 no
    less accurate: its partial sums are blocked too), its root taken on the
    host; underflow and overflow are those of the norm reduction, which also
    squares elements in the tensor's dtype. Small or non-dense tensors share
    one ``torch._foreach_norm`` call.
    """
    pieces: list[torch.Tensor] = []
    small = []
    for i, t in enumerate(tensors):
        if t.numel() >= DOT_MIN and dense(t):
            pieces.append(squared_norm(t))
        else:
            small.append(i)
    squared = len(pieces)
    pieces += torch._foreach_norm([tensors[i] for i in small]) if small else []
    values = torch.stack(pieces + list(extra)).tolist()
    big, rest, in_small = iter(values[:squared]), iter(values[squared:]), set(small)
    out = [next(rest) if i in in_small else math.sqrt(next(big)) for i in range(len(tensors))]
    return out, values[squared + len(small):]
