"""Adasum (Maleki et al. 2021, "Scaling Distributed Training with Adaptive Summation", MLSys).

Two gradients combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Orthogonal gradients add; identical gradients stay unchanged (no averaging needed);
in between, the component the two share is counted once. The rule is applied separately to
every parameter tensor (the paper's per-layer application): one layer's dot products never
mix with another's, even though DDP packs many layers into one communication bucket.

Over ``n`` workers the combination is a binary tree, computed by **recursive doubling on
whole tensors**: at distance ``d = 1, 2, 4, ...`` each rank exchanges its current vector
with rank ``rank XOR d`` and both compute ``adasum(lower rank's, higher rank's)``. After
``log2 n`` rounds every rank holds the same result, bit for bit. Each round moves the whole
bucket, ``log2 n`` bucket sizes per rank in all; the paper's vector-halving
distance-doubling moves ~2 bucket sizes but needs a sub-group all-reduce of the dot
products per round. For the worker counts of data-parallel CPU/GPU jobs the simpler
schedule is a fair trade, and the result is the same tree.

World size not a power of two: with ``p`` the largest power of two below ``n``, rank
``p + i`` first sends its vector to rank ``i`` which folds it in with ``adasum(v_i,
v_{p+i})``; ranks ``0 .. p-1`` then run the tree; rank ``i`` sends the result back to rank
``p + i``. `adasum_reduce` computes the same tree sequentially (the spec for tests).

Adasum is scale-equivariant (``adasum(c a, c b) = c adasum(a, b)``), so AMP loss scaling
may be undone before or after. The gradient noise scale assumes a *mean* reduction; it is
not defined for Adasum-reduced gradients.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["adasum", "adasum_allreduce", "adasum_hook", "adasum_reduce"]


def adasum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise Adasum of two same-shape tensors, treated as one vector each.

    The dot products and squared norms accumulate in float64 whatever the input dtype,
    as Horovod's do: in float32, gradients near float32's smallest normal give
    products that underflow to 0, and the result would be the sum instead of the
    Adasum. The combination itself runs in the input dtype. A zero-norm operand
    contributes nothing and leaves the other unchanged. No host sync.
    """
    x, y = a.reshape(-1), b.reshape(-1)
    x64, y64 = x.double(), y.double()
    dot, xx, yy = torch.dot(x64, y64), torch.dot(x64, x64), torch.dot(y64, y64)
    tiny = torch.finfo(torch.float64).tiny
    cx = torch.where(xx > 0, 1.0 - dot / (2.0 * xx.clamp_min(tiny)), torch.ones_like(xx))
    cy = torch.where(yy > 0, 1.0 - dot / (2.0 * yy.clamp_min(tiny)), torch.ones_like(yy))
    return (cx.to(x.dtype) * x + cy.to(y.dtype) * y).reshape(a.shape)


def adasum_reduce(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum of ``n`` tensors in exactly the tree `adasum_allreduce` uses over ``n`` ranks."""
    if not vectors:
        raise ValueError("adasum_reduce needs at least one tensor")
    vs = list(vectors)
    p = 1 << (len(vs).bit_length() - 1)
    for i in range(len(vs) - p):
        vs[i] = adasum(vs[i], vs[p + i])
    vs = vs[:p]
    while len(vs) > 1:
        vs = [adasum(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    return vs[0]


def _combine(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Per-segment adasum of two flat buffers cut into ``lengths``."""
    return torch.cat(
        [
            adasum(x, y)
            for x, y in zip(torch.split(a, lengths), torch.split(b, lengths), strict=True)
        ]
    )


def _adasum_flat(
    flat: torch.Tensor, lengths: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Adasum-allreduce a flat buffer whose segments ``lengths`` are separate tensors."""
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n == 1:
        return flat

    def peer(r: int) -> int:
        return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)

    def exchange(mine: torch.Tensor, r: int) -> torch.Tensor:
        theirs = torch.empty_like(mine)
        req = dist.isend(mine, peer(r), group=group)
        dist.recv(theirs, peer(r), group=group)
        req.wait()
        return theirs

    p = 1 << (n.bit_length() - 1)
    if rank >= p:  # folded into rank - p, which sends the final result back
        dist.send(flat, peer(rank - p), group=group)
        out = torch.empty_like(flat)
        dist.recv(out, peer(rank - p), group=group)
        return out
    if rank < n - p:
        extra = torch.empty_like(flat)
        dist.recv(extra, peer(rank + p), group=group)
        flat = _combine(flat, extra, lengths)
    d = 1
    while d < p:
        partner = rank ^ d
        other = exchange(flat, partner)
        flat = _combine(flat, other, lengths) if rank < partner else _combine(other, flat, lengths)
        d <<= 1
    if rank < n - p:
        dist.send(flat, peer(rank + p), group=group)
    return flat


def adasum_allreduce(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """In place: every tensor becomes the Adasum over ranks of that tensor (per tensor).

    All tensors travel in one message per round (same dtype and device required).
    Returns ``tensors`` as a list. A collective: every rank of ``group`` must call it with
    tensors of the same shapes in the same order.
    """
    tensors = list(tensors)
    if not tensors or dist.get_world_size(group) == 1:
        return tensors
    lengths = [t.numel() for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out = _adasum_flat(flat, lengths, group)
    for t, r in zip(tensors, torch.split(out, lengths), strict=True):
        t.copy_(r.view_as(t))
    return tensors


def adasum_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Adasum per parameter tensor instead of the mean.

    ``ddp_model.register_comm_hook(process_group_or_None, adasum_hook)``. The bucket's flat
    buffer is cut back into its parameters' gradients (``bucket.gradients()``), so each
    layer is combined on its own. Runs synchronously and returns a completed future.
    """
    buf = bucket.buffer()
    grads = bucket.gradients()
    adasum_allreduce(grads, process_group)  # views of ``buf``: writes the result into it
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
