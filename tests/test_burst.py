"""Burst parallelism runs (`bigbatch.parallel.burst`): a model whose segments have
different data-parallel widths equals one process on the whole batch, on 4 gloo ranks
(one start for all the layouts below)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.parallel.burst import boundary_groups

LAYOUTS = [[4, 2], [4, 4, 1], [2, 4], [1, 2, 4, 2]]
BATCH, STEPS, WIDTH = 8, 3, 12


def _model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh()),
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            nn.Linear(WIDTH, 3)]


def _segments(widths: list[int]) -> list[nn.Module]:
    blocks = _model()
    cut = [len(blocks) * i // len(widths) for i in range(len(widths) + 1)]
    return [nn.Sequential(*blocks[a:b]) for a, b in zip(cut, cut[1:], strict=False)]


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _one_process(widths: list[int]) -> list[torch.Tensor]:
    model = nn.Sequential(*_segments(widths))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _data(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker() -> dict:
    import torch.distributed as dist

    from bigbatch.parallel.burst import Burst

    torch.set_num_threads(1)
    rank, out = dist.get_rank(), {}
    for widths in LAYOUTS:
        segments = _segments(widths)
        initial = [[p.detach().clone() for p in seg.parameters()] for seg in segments]
        burst = Burst(segments, widths)
        params = burst.parameters()
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None
        for step in range(STEPS):
            x, y = _data(step)
            for p in params:
                p.grad = None
            xin = x[burst.input_rows(BATCH)] if rank < widths[0] else None
            burst.forward_backward(xin, y[burst.target_rows(BATCH)], F.cross_entropy, BATCH)
            burst.reduce_gradients()
            if opt is not None:
                opt.step()
        held = [i for i, seg in enumerate(burst.segments) if seg is not None]
        out[str(widths)] = {
            "held": held,
            "weights": {i: [p.detach().clone() for p in segments[i].parameters()]
                        for i in held},
            "moved": any(not torch.equal(a, b) for i in held
                         for a, b in zip(initial[i], segments[i].parameters(), strict=True)),
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, world_size=4, timeout=120, init_group=True)


def test_boundary_groups():
    assert boundary_groups(4, 2) == [[0, 2], [1, 3]]
    assert boundary_groups(4, 1) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("widths", LAYOUTS, ids=str)
def test_burst_layout_equals_one_process(results, widths):
    expect = _one_process(widths)
    sizes = [len(list(seg.parameters())) for seg in _segments(widths)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    worst = 0.0
    for rank, got in enumerate(results):
        mine = got[str(widths)]
        assert mine["held"] == [i for i, w in enumerate(widths) if rank < w]
        if mine["held"]:
            assert mine["moved"]
        for i, weights in mine["weights"].items():
            for a, b in zip(weights, expect[starts[i]:starts[i] + sizes[i]], strict=True):
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    print(f"burst {widths}: max relative weight difference {worst:.2e}")
    assert worst < 1e-6, worst
