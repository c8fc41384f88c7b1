"""Adasum: the pairwise rule, the sequential tree, and the collective/DDP hook on 2, 3, 4 ranks."""

import copy

import pytest
import torch
import torch.distributed as dist

from bigbatch.adaptive.adasum import adasum, adasum_allreduce, adasum_hook, adasum_reduce


def _by_hand(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double().flatten(), b.double().flatten()
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


def test_pairwise_rule_by_hand():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    # a.b = 1, |a|^2 = 1, |b|^2 = 2: 0.5 a + 0.75 b
    torch.testing.assert_close(adasum(a, b), torch.tensor([1.25, 0.75]))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    out = adasum(x, y)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out.double().flatten(), _by_hand(x, y), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adasum(x, y), adasum(y, x))


def test_orthogonal_add_identical_unchanged_opposite_cancel():
    a, b = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, -2.0, 0.0])
    torch.testing.assert_close(adasum(a, b), a + b)
    torch.testing.assert_close(adasum(a, a), a)
    torch.testing.assert_close(adasum(a, -a), torch.zeros(3))
    torch.testing.assert_close(adasum(2 * a, 2 * b), 2 * adasum(a, b))  # scale-equivariant


def test_zero_norms_are_guarded():
    z, a = torch.zeros(4), torch.arange(4.0)
    torch.testing.assert_close(adasum(z, a), a)
    torch.testing.assert_close(adasum(a, z), a)
    torch.testing.assert_close(adasum(z, z), z)


def test_half_precision_accumulates_in_float64():
    a = torch.full((64,), 300.0, dtype=torch.float16)  # |a|^2 overflows float16
    out = adasum(a, a)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, a)


def _reduce_by_hand(vectors):
    """`adasum_reduce`'s tree in float64 with the pairwise rule written out."""
    vs = [v.double().flatten() for v in vectors]
    p = 1 << (len(vs).bit_length() - 1)
    for i in range(len(vs) - p):
        vs[i] = _by_hand(vs[i], vs[p + i])
    vs = vs[:p]
    while len(vs) > 1:
        vs = [_by_hand(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    return vs[0]


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_tiny_float32_gradients_agree_with_float64(ranks):
    # Near float32's smallest normal (1.2e-38) the squares and products underflow in
    # float32; the scalars must accumulate in float64 (Horovod does) or the result
    # degrades to the plain sum (relative error 1, 3 and 7 on 2, 4 and 8 ranks).
    gen = torch.Generator().manual_seed(ranks)
    base = torch.rand(256, generator=gen) + 1.0
    vectors = [base * (0.9 + 0.2 * torch.rand(256, generator=gen)) * 2e-38 for _ in range(ranks)]
    assert all(v.dtype == torch.float32 and (v.abs() >= torch.finfo(torch.float32).tiny).all()
               for v in vectors)
    got = adasum_reduce(vectors).double()
    want = _reduce_by_hand(vectors)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-5, rel
    # Near-parallel gradients average rather than add.
    assert float(got.norm() / vectors[0].double().norm()) < 1.5


def test_reduce_tree_shapes():
    gen = torch.Generator().manual_seed(1)
    v = [torch.randn(6, generator=gen) for _ in range(5)]
    torch.testing.assert_close(adasum_reduce(v[:1]), v[0])
    torch.testing.assert_close(adasum_reduce(v[:2]), adasum(v[0], v[1]))
    four = adasum(adasum(v[0], v[1]), adasum(v[2], v[3]))
    torch.testing.assert_close(adasum_reduce(v[:4]), four)
    three = adasum(adasum(v[0], v[2]), v[1])  # rank 2 folds into rank 0 first
    torch.testing.assert_close(adasum_reduce(v[:3]), three)
    five = adasum(adasum(adasum(v[0], v[4]), v[1]), adasum(v[2], v[3]))
    torch.testing.assert_close(adasum_reduce(v), five)
    eye = torch.eye(5)
    torch.testing.assert_close(
        adasum_reduce(list(eye * torch.arange(1.0, 6.0))), torch.arange(1.0, 6.0)
    )
    with pytest.raises(ValueError):
        adasum_reduce([])


# ----------------------------------------------------------------------------- processes


SHAPES = [(3, 4), (5,), (2, 2, 2), (1,)]


def _data(r: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + r)
    return [torch.randn(*s, generator=gen).to(dtype) for s in SHAPES]


SIZES = (2, 3, 4)  # a pair, an odd number (one rank folds in first), a two-level tree


def _worker() -> None:
    """Four gloo ranks (made by `run_workers`) check the groups of their first 2, 3 and 4
    ranks, the last being the default group (``group=None``); one process start for all
    three. Raises on a mismatch, naming the group."""
    rank = dist.get_rank()
    # new_group is collective over every rank, member or not: all groups are made up front.
    groups = {n: dist.new_group(list(range(n))) for n in SIZES[:-1]} | {SIZES[-1]: None}
    subgroups = {n: dist.new_group(list(range(1, n))) for n in SIZES if n >= 3}
    for n in SIZES:
        if rank >= n:
            continue
        try:
            _check_collective(rank, n, groups[n], subgroups.get(n))
            _check_ddp_hook(rank, n, groups[n])
        except AssertionError as e:
            raise AssertionError(f"rank {rank} in the group of ranks 0..{n - 1}: {e}") from e


def _check_collective(rank: int, world: int, group, sub) -> None:
    for dtype in (torch.float32, torch.float64):
        mine = _data(rank, dtype)
        out = adasum_allreduce(mine, group=group)
        assert out[0] is mine[0]  # in place
        everyone = [_data(r, dtype) for r in range(world)]
        for i, t in enumerate(mine):
            expected = adasum_reduce([d[i] for d in everyone])
            torch.testing.assert_close(t, expected, rtol=1e-6, atol=1e-7)
        # Bit-identical on every rank.
        gathered = [torch.empty_like(mine[0]) for _ in range(world)]
        dist.all_gather(gathered, mine[0], group=group)
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    # Orthogonal gradients add up; identical ones stay unchanged.
    ortho = [torch.eye(world)[rank] * (rank + 1.0)]
    adasum_allreduce(ortho, group=group)
    torch.testing.assert_close(ortho[0], torch.arange(1.0, world + 1.0))
    same = _data(0)
    adasum_allreduce(same, group=group)
    for t, ref in zip(same, _data(0), strict=True):
        torch.testing.assert_close(t, ref)
    # A subgroup of the ranks (global ranks are not group ranks).
    if sub is not None:
        members = list(range(1, world))
        if rank in members:
            t = [_data(rank)[0]]
            adasum_allreduce(t, group=sub)
            expected = adasum_reduce([_data(r)[0] for r in members])
            torch.testing.assert_close(t[0], expected, rtol=1e-6, atol=1e-7)


def _check_ddp_hook(rank: int, world: int, group) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    per_rank = []
    for x in xs:
        ref.zero_grad()
        ref(x).pow(2).mean().backward()
        per_rank.append([p.grad.clone() for p in ref.parameters()])
    # One bucket holds every layer.
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(group, adasum_hook)
    ddp(xs[rank]).pow(2).mean().backward()
    params = list(model.parameters())
    for i, p in enumerate(params):
        expected = adasum_reduce([g[i] for g in per_rank])
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6)
    # Per tensor, not per bucket: the whole-bucket combination is something else.
    flat = adasum_reduce([torch.cat([t.flatten() for t in g]) for g in per_rank])
    ours = torch.cat([p.grad.flatten() for p in params])
    assert not torch.allclose(ours, flat, rtol=1e-3, atol=1e-4)


def test_collective_and_ddp_hook_on_2_3_4_ranks():
    from tests._dist import run_workers

    run_workers(_worker, 4, timeout=120, init_group=True)
