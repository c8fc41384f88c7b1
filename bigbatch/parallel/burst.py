"""Burst parallelism (DeepPool, Park et al., MLSys 2022): each segment of a model runs
data-parallel over its own number of ranks, for one fixed global batch.

    burst = Burst([blocks_a, blocks_b], widths=[4, 2])     # on 4 ranks
    x = inputs[burst.input_rows(batch)]                      # this rank's first rows
    y = targets[burst.target_rows(batch)]                    # the rows its last segment has
    loss = burst.forward_backward(x, y, loss_fn, batch)      # mean over the global batch
    burst.reduce_gradients()
    optimizer.step()                                         # over burst.parameters()

Segment ``s`` runs on ranks ``0 .. widths[s]-1``, each on ``batch / widths[s]`` samples.
Where the width narrows from ``w`` to ``n`` (``n`` divides ``w``), rank ``j < n``
gathers the activations of ranks ``j, j + n, j + 2n, ...`` (a `dist.gather` in a group of
those ranks) and in backward scatters their gradients back (`dist.scatter`); where it
widens, the reverse. A segment's gradients are summed over its own ranks (an all-reduce
in the group of its width) and the loss is each rank's share of the global mean, so the
step equals one process on the whole batch. The collectives are torch.distributed's on
sub-groups; a rank outside a segment holds no copy of it and waits at the boundary.

The planning half, which widths to give each layer, is `bigbatch.planner.burst`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.errors import ConfigError

__all__ = ["Burst", "boundary_groups"]

_MAX_DIMS = 8


def boundary_groups(wide: int, narrow: int) -> list[list[int]]:
    """The ranks each narrow rank ``j`` exchanges with at a boundary between widths:
    ``[j, j + narrow, j + 2 narrow, ...]`` (``j`` first: it gathers, or scatters)."""
    return [list(range(j, wide, narrow)) for j in range(narrow)]


class _Boundary(torch.autograd.Function):
    """Narrowing: the root gathers its group's activations (forward) and scatters their
    gradients (backward); a widening boundary does the reverse. A rank without
    activations on one side passes (and gets) an empty tensor."""

    @staticmethod
    def forward(ctx, x, group, root, members, gather):
        ctx.group, ctx.root, ctx.members, ctx.gather, ctx.shape = (
            group, root, members, gather, x.shape)
        me = dist.get_rank()
        if gather:
            if me == root:
                parts = [torch.empty_like(x) for _ in range(members)]
                dist.gather(x.contiguous(), parts, dst=root, group=group)
                return torch.cat(parts)
            dist.gather(x.contiguous(), None, dst=root, group=group)
            return x.new_empty((0,))
        # Widening: the receivers learn the shape of their part from the root first.
        head = torch.zeros(_MAX_DIMS + 1, dtype=torch.long)
        if me == root:
            part = (x.shape[0] // members, *x.shape[1:])
            head[0] = len(part)
            head[1:len(part) + 1] = torch.tensor(part)
        dist.broadcast(head, src=root, group=group)
        out = torch.empty(head[1:int(head[0]) + 1].tolist(), dtype=x.dtype, device=x.device)
        parts = list(x.contiguous().chunk(members)) if me == root else None
        dist.scatter(out, parts, src=root, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        me = dist.get_rank()
        if ctx.gather:
            out = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
            parts = list(grad.contiguous().chunk(ctx.members)) if me == ctx.root else None
            dist.scatter(out, parts, src=ctx.root, group=ctx.group)
            return out, None, None, None, None
        if me == ctx.root:
            parts = [torch.empty_like(grad) for _ in range(ctx.members)]
            dist.gather(grad.contiguous(), parts, dst=ctx.root, group=ctx.group)
            return torch.cat(parts).view(ctx.shape), None, None, None, None
        dist.gather(grad.contiguous(), None, dst=ctx.root, group=ctx.group)
        return grad.new_zeros(ctx.shape), None, None, None, None


class Burst:
    """A model as a chain of `segments`, segment ``s`` data-parallel over the first
    ``widths[s]`` ranks of the default process group (module docstring). Every rank
    passes the same segments (built alike, e.g. from one seed); each keeps those it runs.
    Consecutive widths must divide one another, the first and the largest at most the
    world size."""

    def __init__(self, segments: Sequence[nn.Module], widths: Sequence[int]) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        widths = [int(w) for w in widths]
        if len(segments) != len(widths) or not segments:
            raise ConfigError(f"Burst: {len(segments)} segments and {len(widths)} widths; "
                              "give one width per segment")
        for w in widths:
            if not 1 <= w <= world:
                raise ConfigError(f"Burst: width {w} outside 1..{world} (the world size)")
        for a, b in zip(widths, widths[1:], strict=False):
            if max(a, b) % min(a, b):
                raise ConfigError(f"Burst: widths {a} then {b}: one must divide the other")
        self.widths, self.rank = widths, rank
        self.segments = [seg if rank < w else None for seg, w in zip(segments, widths,
                                                                   strict=True)]
        # Every rank makes every group, in one order (new_group is collective).
        self._width_groups = {w: dist.new_group(list(range(w))) for w in sorted(set(widths))}
        self._boundaries = []
        for a, b in zip(widths, widths[1:], strict=False):
            if a == b:
                self._boundaries.append(None)
                continue
            wide, narrow = max(a, b), min(a, b)
            groups = [(g, dist.new_group(g)) for g in boundary_groups(wide, narrow)]
            mine = next(((g, pg) for g, pg in groups if rank in g), None)
            self._boundaries.append((a > b, mine))

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank holds (the segments it runs)."""
        return [p for seg in self.segments if seg is not None for p in seg.parameters()]

    def _rows(self, batch: int) -> list[list[int]]:
        """Per segment, the global sample indices this rank runs, in order."""
        w0 = self.widths[0]
        per = [list(range(r * batch // w0, (r + 1) * batch // w0)) for r in range(w0)]
        out = [per[self.rank] if self.rank < w0 else []]
        for a, b in zip(self.widths, self.widths[1:], strict=False):
            if b < a:
                per = [[i for r in g for i in per[r]] for g in boundary_groups(a, b)]
            elif b > a:
                split: list[list[int]] = [[] for _ in range(b)]
                for j, g in enumerate(boundary_groups(b, a)):
                    n = len(per[j]) // len(g)
                    for k, r in enumerate(g):
                        split[r] = per[j][k * n:(k + 1) * n]
                per = split
            out.append(per[self.rank] if self.rank < b else [])
        return out

    def input_rows(self, batch: int) -> list[int]:
        """The global batch's rows this rank feeds the first segment (none outside it)."""
        return self._rows(batch)[0]

    def target_rows(self, batch: int) -> list[int]:
        """The rows of the targets the last segment's output on this rank belongs to."""
        return self._rows(batch)[-1]

    def _check(self, batch: int) -> None:
        for w in self.widths:
            if batch % w:
                raise ConfigError(f"Burst: a global batch of {batch} does not split over "
                                  f"width {w}; use a multiple of every width")

    def forward_backward(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         batch: int) -> torch.Tensor | None:
        """One micro-step: forward through this rank's segments, backward through all
        boundaries. `loss_fn(output, targets)` is a mean over its rows; this rank's part
        of the global mean is backpropagated and returned (None on a rank that ends
        outside the last segment). `inputs`: this rank's `input_rows` (None outside the
        first segment), `targets`: its `target_rows`."""
        self._check(batch)
        # A rank outside the first segment enters with an empty tensor that wants a
        # gradient, so that autograd reaches its boundaries' backward collectives.
        x = inputs if inputs is not None else torch.zeros(0, requires_grad=True)
        for s, seg in enumerate(self.segments):
            if seg is not None:
                x = seg(x)
            if s < len(self._boundaries) and self._boundaries[s] is not None \
                    and self._boundaries[s][1] is not None:  # None: a rank beyond both widths
                narrowing, (members, group) = self._boundaries[s]
                x = _Boundary.apply(x, group, members[0], len(members), narrowing)
        if self.segments[-1] is not None:
            loss = loss_fn(x, targets) * (x.shape[0] / batch)
            loss.backward()
            return loss.detach()
        x.backward(torch.zeros_like(x))
        return None

    def reduce_gradients(self) -> None:
        """Sum each segment's gradients over the ranks of its width (one all-reduce per
        tensor; the loss already carries the 1/batch)."""
        for seg, w in zip(self.segments, self.widths, strict=True):
            if seg is None or w == 1:
                continue
            group = self._width_groups[w]
            for p in seg.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
