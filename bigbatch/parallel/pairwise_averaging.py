"""Pairwise model averaging on a hypercube: at each average every worker averages its
weights with one peer over point-to-point sends, in a fixed order (KungFu's pairwise
averaging, Mai et al. OSDI 2020; AD-PSGD, Lian et al. 2018, made synchronous).

The peer of rank r at the j-th average (0-based) is ``r XOR 2^(j mod log2 N)``, N a
power of two: the pairs of one average are disjoint and symmetric, and log2 N averages
in a row with no step between them give every worker the mean of all N models (the
butterfly all-reduce), so information from every worker reaches every other within
log2 N averages. Both peers compute ``(own + theirs) / 2``; float addition commutes, so
the two hold bit-identical weights afterwards.

Per average a worker sends one model to one peer and receives one (its parameters, one
message per dtype); a ring all-reduce sends 2 (N-1)/N models per worker (1 at N = 2,
1.5 at N = 4, towards 2) in 2 (N-1) rounds that involve every worker.

Why not asynchronous (AD-PSGD as published, KungFu's default): there a worker averages
with whatever model its peer holds when the request lands, and the peer keeps stepping
meanwhile, so which versions meet depends on timing: no two runs agree, and neither
can be checked against a reference or resumed exactly. The traffic per step is the
same here (one peer, point-to-point); what the synchronous form gives up is that a
slow worker holds up its peer of that step (and through the pairs, the others within
log2 N steps) instead of being averaged with stale.

Only weights are averaged: optimizer state (momentum, Adam moments) stays each worker's
own, as under `[localsgd]`'s all-worker average. Buffers (BatchNorm statistics) are not
exchanged either.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist

from bigbatch.parallel.p2p import exchange, group_timeout

__all__ = ["PairwiseAverager", "hypercube_peer"]


def hypercube_peer(rank: int, index: int, world_size: int) -> int:
    """The peer of `rank` at average `index` (0-based): rank XOR 2^(index mod log2 N),
    `world_size` N a power of two."""
    if world_size < 1 or world_size & (world_size - 1):
        raise ValueError(f"hypercube pairs need a power-of-two world size, got {world_size}")
    dims = world_size.bit_length() - 1
    return rank if dims == 0 else rank ^ (1 << (index % dims))


class PairwiseAverager:
    """Averages a worker's parameters with its hypercube peer of each average."""

    def __init__(self, group: dist.ProcessGroup | None = None,
                 timeout: datetime.timedelta | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        hypercube_peer(self.rank, 0, self.world_size)  # a power of two (`degrees` says so first)
        self.timeout = timeout
        self.peer: int | None = None
        """The peer (a rank of `group`) of the latest average."""

    @torch.no_grad()
    def average(self, params: Iterable[torch.Tensor], index: int) -> int:
        """Average `params` in place with the peer of average `index`; return the peer."""
        peer = hypercube_peer(self.rank, index, self.world_size)
        self.peer = peer
        if peer == self.rank:
            return peer
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for (_, device), tensors in by_dtype.items():
            timeout = self.timeout or group_timeout(self.group, device)
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            flat.add_(exchange(flat, peer, self.group, timeout)).mul_(0.5)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return peer
