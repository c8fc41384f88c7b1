"""A function of whole matrices applied to sharded or replicated ones: each rank keeps its
own piece, and each whole matrix is computed once.

Muon's update of a matrix is a function of the *whole* matrix (its Newton-Schulz
orthogonalisation), as LAMB's trust ratio is a function of the whole tensor's norm.
Under FSDP2 (ZeRO-2/3: rows sharded on dim 0) and tensor parallelism (columns or rows
sliced) each rank holds a piece; under data parallelism every rank holds a copy.
`apply_whole(fn, pieces, owners)` returns, for each piece, this rank's piece of
``fn(whole matrix)``. How, by the parameter's layout (mesh dimensions of one rank count
as neither sharded nor replicated):

- plain tensors, and DTensors sharded on no mesh dimension: ``fn`` on the local tensor;
- DTensors sharded on one mesh dimension by a plain ``Shard(d)`` (FSDP2 alone, tensor
  parallelism alone or with data replicas): every matrix gets an *owner* rank of that
  dimension. One ``all_to_all_single`` moves every rank's pieces to their owners, each
  owner applies ``fn`` to whole matrices only, and one more sends each rank its piece
  back: two collectives per step for all matrices of that dimension, each rank sending
  about its own shards' size;
- anything else (a 2-D mesh with both dimensions sharded: tensor parallel x ZeRO-3,
  FSDP2's ``_StridedShard``): ``full_tensor()`` (torch's all-gather), ``fn`` on every
  rank of the mesh's sharded dimensions, and this rank's piece cut out locally
  (``distribute_tensor`` without a source rank sends nothing).

Replicas split the work instead of repeating it: ranks that hold the same pieces and
step them on the same gradients (DDP's data ranks, passed as ``replicas``; a DTensor's
replicated mesh dimension, the largest if several: HSDP's and data x tensor parallel's
``dp_replicate``). Each matrix is computed on one replica only (with an owner above: one
(replica, owner) pair among replicas x owner ranks), and one all-gather over the
replicas (``all_gather_single``; ``all_gather_into_tensor`` before torch 2.13) hands
every replica every result: each replica's results flattened into one bucket, padded to
the largest bucket. ``spread=False`` repeats the work on every replica instead and sends
nothing for it.

Owners and replicas are chosen so that the work (``cost``) is spread: largest first to
the least loaded rank (no rank above about 1.2x the mean once there are a few matrices
per rank; `balance` and `split_work` report it), the same answer on every rank.

Every collective is torch's (c10d over the process group or the DTensor's device-mesh
groups); nothing here reads a tensor to the host, so a CUDA step does not synchronise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import zip_longest

import torch
import torch.distributed as dist

from ._norms import is_dtensor, local

__all__ = ["apply_whole", "assign_owners", "balance", "ns_cost", "shard_bounds",
           "split_work"]

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


def _layout(w: torch.Tensor, replicas, spread: bool) -> tuple[str, object, int, object]:
    """(how, shard group, tensor dim, replica group) of the parameter ``w`` (module
    docstring): how is ``"whole"``, ``"owner"`` (the shard group and the sharded tensor
    dim given) or ``"gather"``; the replica group is None where the work is not split."""
    if not is_dtensor(w):
        return "whole", None, -1, replicas if spread else None
    from torch.distributed.tensor import Shard

    mesh = w.device_mesh
    live = [(d, p) for d, p in enumerate(w.placements) if mesh.size(d) > 1]
    copies = [d for d, p in live if p.is_replicate()]
    group = mesh.get_group(max(copies, key=mesh.size)) if spread and copies else None
    sharded = [(d, p) for d, p in live if not p.is_replicate()]
    if not sharded:
        return "whole", None, -1, group
    if len(sharded) == 1 and type(sharded[0][1]) is Shard:
        return "owner", mesh.get_group(sharded[0][0]), sharded[0][1].dim, group
    return "gather", None, -1, group


def _work(owners: Sequence[torch.Tensor], pieces: Sequence[torch.Tensor], replicas,
          spread: bool) -> dict:
    """The parameters by how their whole matrices are made: {(how, shard group, replica
    group, the pieces' dtype and device): [(index, sharded tensor dim)]}."""
    work: dict = {}
    for i, (w, piece) in enumerate(zip(owners, pieces, strict=True)):
        how, shard, dim, copies = _layout(w, replicas, spread)
        work.setdefault((how, shard, copies, piece.dtype, piece.device), []).append((i, dim))
    return work


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _assign(how: str, shard, copies, costs: list[int]) -> tuple[list[int], list[int]]:
    """`assign_owners` over replicas x owner ranks (replica ``o // ranks``, owner rank
    ``o % ranks`` of each matrix's ``o``)."""
    return assign_owners(costs, _size(copies) * (_size(shard) if how == "owner" else 1))


def split_work(owners: Sequence[torch.Tensor], cost: Callable[[Sequence[int]], int] = ns_cost,
               replicas=None, spread: bool = True) -> list[int]:
    """``cost`` of the whole matrices each rank computes in `apply_whole` for parameters laid
    out like ``owners``, one entry per rank the work is split over (replicas x owner ranks;
    where layouts with different splits mix, their loads are added rank by rank): its
    max over its mean is the balance."""
    total: list[int] = []
    work = _work(owners, [local(w) for w in owners], replicas, spread)
    for (how, shard, copies, _, _), items in work.items():
        _, loads = _assign(how, shard, copies, [cost(owners[i].shape) for i, _ in items])
        total = [a + b for a, b in zip_longest(total, loads, fillvalue=0)]
    return total


def apply_whole(fn: WholeFn, pieces: Sequence[torch.Tensor], owners: Sequence[torch.Tensor],
                cost: Callable[[Sequence[int]], int] = ns_cost, replicas=None,
                spread: bool = True) -> list[torch.Tensor]:
    """This rank's piece of ``fn([whole])`` for each local ``pieces[i]``, laid out like the
    parameter ``owners[i]`` (see the module docstring). ``fn`` takes a list of whole
    tensors and returns as many of the same shapes; it is called once per kind of layout
    with every matrix this rank computes (so it can batch them). ``replicas``: the process
    group whose ranks hold the same plain tensors and inputs (DDP's), over which their
    work is split; ``spread=False``: every replica computes every matrix itself (neither
    ``replicas`` nor a DTensor's replicated mesh dimensions are used)."""
    out: list = [None] * len(pieces)
    for (how, shard, copies, _, _), items in _work(owners, pieces, replicas, spread).items():
        owner, _ = _assign(how, shard, copies, [cost(owners[i].shape) for i, _ in items])
        ranks = _size(shard) if how == "owner" else 1
        me = dist.get_rank(copies) if copies is not None else 0
        mine = [k for k, o in enumerate(owner) if o // ranks == me]
        chosen = [items[k] for k in mine]
        if not chosen:
            made = []
        elif how == "whole":
            made = fn([pieces[i] for i, _ in chosen])
        elif how == "owner":
            made = _by_owner(fn, shard, [(pieces[i], owners[i].shape, d) for i, d in chosen],
                             [owner[k] % ranks for k in mine])
        else:
            made = _gather_all(fn, [pieces[i] for i, _ in chosen], [owners[i] for i, _ in chosen])
        results: list = [None] * len(items)
        for k, r in zip(mine, made, strict=True):
            results[k] = r
        if _size(copies) > 1:
            _share(copies, [o // ranks for o in owner], results, [pieces[i] for i, _ in items])
        for (i, _), r in zip(items, results, strict=True):
            out[i] = r
    return out


def _share(group, replica_of: list[int], results: list, like: list[torch.Tensor]) -> None:
    """Fill ``results`` (this replica's made, the rest None) with every replica's: one
    all-gather of each replica's results, flattened into one bucket padded to the
    largest; ``like``: tensors of the results' shapes, dtype and device."""
    copies, me = dist.get_world_size(group), dist.get_rank(group)
    of = [[k for k, r in enumerate(replica_of) if r == c] for c in range(copies)]
    sizes = [sum(like[k].numel() for k in ks) for ks in of]
    width = max(sizes)
    first = like[0]
    gathered = first.new_empty(copies * width)
    if width:
        send = torch.cat([results[k].reshape(-1) for k in of[me]]
                         + [first.new_zeros(width - sizes[me])])
        # torch 2.13's name for what 2.11 calls all_gather_into_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, send, group=group)
    for c in range(copies):
        if c == me:
            continue
        bucket = gathered.narrow(0, c * width, sizes[c])
        for k, flat in zip(of[c], bucket.split([like[k].numel() for k in of[c]]), strict=True):
            results[k] = flat.view(like[k].shape)


def _piece_shape(shape: Sequence[int], dim: int, ranks: int, rank: int) -> list[int]:
    start, end = shard_bounds(int(shape[dim]), ranks, rank)
    return [end - start if k == dim else int(n) for k, n in enumerate(shape)]


def _by_owner(fn: WholeFn, group, items: list[tuple[torch.Tensor, Sequence[int], int]],
              owner: list[int]) -> list[torch.Tensor]:
    """Pieces to their ``owner`` ranks of ``group``, ``fn`` there, pieces back: two
    ``all_to_all_single``."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
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
