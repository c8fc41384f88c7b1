"""The data side of an own loop under tensor parallelism (2 gloo ranks, degree 2): one
data-parallel replica, so both ranks must read the same samples. `run.loader(data)`
gives them that and equals one process; the documented-before
`DistributedSampler(data, world_size, rank)` gave each rank different rows and trained
wrong silently: it now stops at the first step in one line."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from bigbatch.config.strategy import Strategy
from bigbatch.engine.data_share import InputMismatchError
from bigbatch.engine.prepare import prepare

STEPS = 4
TOML = """
[batch]
global_batch_size = 8
micro_batch_size = 8
base_batch_size = 8
base_lr = 0.05
[lamb]
[optimizer]
type = "adamw"
[tensor_parallel]
tensor_parallel_degree = {tp}
"""


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 8, 6, generator=g)
    return TensorDataset(x, x[:, :3].argmax(1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def train(tp: int, sampler_kind: str = "loader") -> dict:
    from torch.distributed.tensor import DTensor

    run = prepare(model(), Strategy.from_toml(TOML.format(tp=tp)), total_steps=STEPS,
                  tp_plan={"0": "colwise", "2": "rowwise"})
    try:
        if sampler_kind == "loader":
            loader = run.loader(data(), seed=3)
        else:  # the global rank among the world: each tensor rank reads other rows
            loader = torch.utils.data.DataLoader(
                data(), batch_size=8, drop_last=True,
                sampler=DistributedSampler(data(), run.world.world_size, run.world.rank,
                                           seed=3))
        loader.sampler.set_epoch(0)
        for xb, yb in loader:
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(xb), yb))
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for n, p in run.module.named_parameters()}
    finally:
        run.close()


def _worker():
    weights = train(2)
    try:
        train(2, "world")
        refused = None
    except InputMismatchError as e:
        refused = str(e)
    return weights, refused


def test_run_loader_feeds_tensor_ranks_alike_and_a_world_sampler_is_refused():
    per_rank = run_workers(_worker, world_size=2, timeout=60)
    single = train(1)  # one process: data degree 1, the whole data set
    for weights, refused in per_rank:
        for name, w in weights.items():
            torch.testing.assert_close(w, single[name], rtol=1e-5, atol=1e-6)
        assert refused is not None and "\n" not in refused
        assert refused.startswith("tensor-parallel ranks got different inputs at the first "
                                  "step"), refused
        assert "run.loader(data)" in refused
