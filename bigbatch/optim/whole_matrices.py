"""A function of whole matrices applied to sharded ones: each rank keeps its own piece.

Muon's update of a matrix is a function of the *whole* matrix (its Newton-Schulz
orthogonalisation), as LAMB's trust ratio is a function of the whole tensor's norm.
Under FSDP2 (ZeRO-2/3: rows sharded on dim 0) and tensor parallelism (columns or rows
sliced) each rank holds a piece. `apply_whole(fn, pieces, owners)` returns, for each
piece, this rank's piece of ``fn(whole matrix)``:

- plain tensors, and DTensors sharded on no mesh dimension: ``fn`` on the local tensor;
- DTensors sharded on one mesh dimension by a plain ``Shard(d)`` (FSDP2 alone, tensor
  parallelism alone): every matrix gets an *owner* rank of that dimension, chosen so that
  the work (``cost``) is spread: largest first to the least loaded rank (no rank above
  about 1.2x the mean once there are a few matrices per rank; `balance` reports it).
  One ``all_to_all_single`` moves every rank's pieces to their owners, each owner
  applies ``fn`` to whole matrices only, and one more sends each rank its piece back:
  two collectives per step for all matrices of that dimension, each rank sending about
  its own shards' size. Replicated mesh dimensions (HSDP's replicas) repeat the work;
- anything else (a 2-D mesh with both dimensions sharded: tensor parallel x ZeRO-3,
  FSDP2's ``_StridedShard``): ``full_tensor()`` (torch's all-gather), ``fn`` on every
  rank, and this rank's piece cut out locally (``distribute_tensor`` without a source
  rank sends nothing).

Every collective is torch's (c10d over the DTensor's device-mesh groups); nothing here
reads a tensor to the host, so a CUDA step does not synchronise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ._norms import is_dtensor, local

__all__ = ["apply_whole", "assign_owners", "balance", "ns_cost", "shard_bounds"]

WholeFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def ns_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix of ``shape`` (rows x the rest):
    with ``s`` the short side and ``l`` the long one, ``X X^T`` and ``B X`` cost ``s*s*l``
    each and ``A A`` costs ``s**3``."""
    rows = int(shape[0])
    cols = 1
    for n in shape[1:]:
        cols *= int(n)
    s, big = min(rows, cols), max(rows, cols)
    return 2 * s * s * big + s ** 3


def assign_owners(costs: Sequence[int], ranks: int) -> tuple[list[int], list[int]]:
    """(owner of each item, total cost per rank): largest first to the least loaded rank
    (ties to the lower index), the same answer on every rank."""
    loads = [0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners, loads


def balance(shapes: Sequence[Sequence[int]], ranks: int) -> float:
    """The most loaded rank's Newton-Schulz work over the mean, for matrices of these
    shapes spread over ``ranks`` by `assign_owners` (1.0: perfectly even)."""
    _, loads = assign_owners([ns_cost(s) for s in shapes], ranks)
    mean = sum(loads) / ranks
    return max(loads) / mean if mean else 1.0


def shard_bounds(size: int, ranks: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s piece of a dimension of ``size`` cut in ``ranks``
    (``torch.chunk``'s cut, which DTensor's ``Shard`` and FSDP2 use: the last may be short
    or empty)."""
    chunk = -(-size // ranks)
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def _single_shard(t: torch.Tensor) -> tuple[int, int] | None:
    """(mesh dim, tensor dim) when ``t`` is sharded by a plain ``Shard`` on exactly one
    mesh dimension and replicated on the rest; None otherwise."""
    from torch.distributed.tensor import Shard

    sharded = [(i, p) for i, p in enumerate(t.placements) if not p.is_replicate()]
    if len(sharded) != 1 or type(sharded[0][1]) is not Shard:
        return None
    mesh_dim, placement = sharded[0]
    return mesh_dim, placement.dim


def apply_whole(fn: WholeFn, pieces: Sequence[torch.Tensor], owners: Sequence[torch.Tensor],
                cost: Callable[[Sequence[int]], int] = ns_cost) -> list[torch.Tensor]:
    """This rank's piece of ``fn([whole])`` for each local ``pieces[i]``, laid out like the
    parameter ``owners[i]`` (see the module docstring). ``fn`` takes a list of whole
    tensors and returns as many of the same shapes; it is called once per kind of layout
    with every matrix this rank computes (so it can batch them)."""
    out: list = [None] * len(pieces)
    whole_here: list[int] = []  # the local piece is the whole matrix
    exchanged: dict = {}  # (group, dtype, device) -> [(i, tensor dim)]
    gathered: list[int] = []
    for i, w in enumerate(owners):
        if not is_dtensor(w) or all(p.is_replicate() for p in w.placements):
            whole_here.append(i)
            continue
        single = _single_shard(w)
        if single is None:
            gathered.append(i)
            continue
        mesh_dim, dim = single
        key = (w.device_mesh.get_group(mesh_dim), pieces[i].dtype, pieces[i].device)
        exchanged.setdefault(key, []).append((i, dim))
    if whole_here:
        for i, r in zip(whole_here, fn([pieces[i] for i in whole_here]), strict=True):
            out[i] = r
    for (group, _, _), items in exchanged.items():
        for (i, _), r in zip(items, _by_owner(fn, group, [(pieces[i], owners[i].shape, d)
                                                           for i, d in items], cost),
                             strict=True):
            out[i] = r
    if gathered:
        out_pieces = _gather_all(fn, [pieces[i] for i in gathered], [owners[i] for i in gathered])
        for i, r in zip(gathered, out_pieces, strict=True):
            out[i] = r
    return out


def _piece_shape(shape: Sequence[int], dim: int, ranks: int, rank: int) -> list[int]:
    start, end = shard_bounds(int(shape[dim]), ranks, rank)
    return [end - start if k == dim else int(n) for k, n in enumerate(shape)]


def _by_owner(fn: WholeFn, group, items: list[tuple[torch.Tensor, Sequence[int], int]],
              cost) -> list[torch.Tensor]:
    """Pieces to their owners, ``fn`` there, pieces back: two ``all_to_all_single``."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    owner, _ = assign_owners([cost(shape) for _, shape, _ in items], ranks)
    mine = [j for j in range(len(items)) if owner[j] == me]

    def size(j: int, rank: int) -> int:
        n = 1
        for k in _piece_shape(items[j][1], items[j][2], ranks, rank):
            n *= k
        return n

    by_rank = [[j for j in range(len(items)) if owner[j] == r] for r in range(ranks)]
    send_sizes = [sum(size(j, me) for j in by_rank[r]) for r in range(ranks)]
    recv_sizes = [sum(size(j, r) for j in mine) for r in range(ranks)]
    first = items[0][0]
    send = torch.cat([items[j][0].reshape(-1) for r in range(ranks) for j in by_rank[r]]
                     or [first.new_empty(0)])
    recv = first.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    # From each rank, its pieces of my matrices in order: stitch each matrix whole.
    parts = list(recv.split(recv_sizes))
    pieces_of: list[list[torch.Tensor]] = [[] for _ in mine]
    for r in range(ranks):
        sizes = [size(j, r) for j in mine]
        for k, flat in enumerate(parts[r].split(sizes)):
            j = mine[k]
            pieces_of[k].append(flat.view(_piece_shape(items[j][1], items[j][2], ranks, r)))
    wholes = [torch.cat(ps, dim=items[j][2]) for j, ps in zip(mine, pieces_of, strict=True)]
    results = fn(wholes) if wholes else []
    # Back: to each rank its piece of every matrix I own; from each owner, mine.
    back = []
    for r in range(ranks):
        for j, res in zip(mine, results, strict=True):
            start, end = shard_bounds(int(items[j][1][items[j][2]]), ranks, r)
            back.append(res.narrow(items[j][2], start, end - start).reshape(-1))
    send_back = torch.cat(back) if back else first.new_empty(0)
    recv_back = first.new_empty(sum(send_sizes))
    dist.all_to_all_single(recv_back, send_back, send_sizes, recv_sizes, group=group)
    out: list = [None] * len(items)
    got = list(recv_back.split(send_sizes))
    for r in range(ranks):
        for j, flat in zip(by_rank[r], got[r].split([size(j, me) for j in by_rank[r]]),
                           strict=True):
            out[j] = flat.view(items[j][0].shape)
    return out


def _gather_all(fn: WholeFn, pieces: list[torch.Tensor], owners: list[torch.Tensor]
                ) -> list[torch.Tensor]:
    """Every rank gathers every matrix (torch's all-gather), applies ``fn``, keeps its piece."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    wholes = [DTensor.from_local(p, w.device_mesh, w.placements, run_check=False,
                                 shape=w.shape, stride=w.stride()).full_tensor()
              for p, w in zip(pieces, owners, strict=True)]
    results = fn(wholes)
    return [local(distribute_tensor(r, w.device_mesh, w.placements, src_data_rank=None))
            for r, w in zip(results, owners, strict=True)]
