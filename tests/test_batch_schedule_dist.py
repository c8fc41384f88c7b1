"""A growing batch under ZeRO 1-3 and tensor parallelism on 2 gloo ranks == one process.

`batch.schedule = "seesaw"` doubles the batch where the cosine decay halves the LR: the
merge steps grow (the micro batch is the ceiling's), mid-run, and the weights still equal
the single-process run on the same global batches (float32, 1e-5), with LAMB, whose
trust ratio needs each whole tensor. The layouts share one spawn of two processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.world import World

CEILING, UNITS = 64, 12
PLAN = {"inp": "colwise", "mid": "rowwise"}
LAYOUTS = ("zero1", "zero2", "zero3", "tp")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.mid = nn.Linear(32, 12)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 12))
                                      for _ in range(2)))
        self.out = nn.Linear(12, 5)

    def forward(self, x):
        return self.out(self.blocks(self.mid(F.gelu(self.inp(x)))))


def make_strategy(layout: str) -> Strategy:
    d: dict = {
        "batch": {"global_batch_size": CEILING, "micro_batch_size": 8, "base_batch_size": 16,
                  "base_lr": 0.01, "scaling": "sqrt", "warmup_steps": 0, "decay": "cosine",
                  "schedule": "seesaw", "start_batch_size": 16, "schedule_interval_steps": 1},
        "gradient_merge": {"avg": True},
        "optimizer": {"type": "adamw", "weight_decay": 0.0},
        "lamb": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["bias"]},
    }
    if layout.startswith("zero"):
        d["sharding"] = {"stage": int(layout[-1])}
    elif layout == "tp":
        d["tensor_parallel"] = {"tensor_parallel_degree": 2}
    return Strategy.from_dict(d)


def train(layout: str, world: World | None = None):
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    run = prepare(Net(), make_strategy(layout), total_steps=UNITS, world=world,
                  tp_plan=PLAN if layout == "tp" else None)
    g = torch.Generator().manual_seed(3)
    W, r = run.mesh.data_degree, run.mesh.data_rank
    batches = []
    while not run.done:
        x, y = torch.randn(CEILING, 12, generator=g), torch.randint(0, 5, (CEILING,), generator=g)
        m, k = run.plan.micro_batch_size, run.k_steps
        batches.append(run.plan.global_batch_size)
        for j in range(k):
            rows = slice((j * W + r) * m, (j * W + r + 1) * m)
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[rows]), y[rows]))
        assert ms.stepped
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in run.module.state_dict().items()}
    return state, batches


def _worker() -> dict:
    return {layout: train(layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def split():
    return run_workers(_worker, world_size=2, timeout=240, init_group=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_growing_batch_under_a_split_model_equals_one_process(split, layout):
    one, batches = train("one", World())
    assert batches[0] == 16 and batches[-1] == 64 and 32 in batches  # it really grew
    for rank in range(2):
        state, got = split[rank][layout]
        assert got == batches
        for name, value in one.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
