"""LARS and LAMB on DTensor parameters: FSDP2 and tensor parallel on 2 gloo ranks.

After 10 steps the full weights equal the single-process run on the same
global batch (float64 to 1e-10, float32 to 1e-5), and every step makes one
all-reduce for the trust-ratio norms (one more for LAMB's global clipping),
never one per tensor. One spawn per optimizer family; the cases loop inside.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _dist import CountCalls, run_workers
from torch import nn

from bigbatch.optim import LAMB, LARS

STEPS = 10
# "auto" is the per-tensor kernel on CPU: torch's fused kernels on each local shard.
KERNELS = ("auto", "multi_tensor")
EXCLUDE = ("bias", "3.")  # biases and the LayerNorm: excluded groups exist

CASES = {
    "LARS": [
        (LARS, dict(lr=0.5, trust_coefficient=0.02, weight_decay=1e-3)),
        (LARS, dict(lr=0.5, trust_coefficient=0.5, weight_decay=1e-3, trust_clip=True,
                    nesterov=True)),
    ],
    "LAMB": [
        (LAMB, dict(lr=0.02, weight_decay=0.01)),
        (LAMB, dict(lr=0.02, weight_decay=0.01, max_grad_norm=0.05)),
    ],
}


def mlp(dtype):
    """The last layer has one output: under FSDP2 rank 1's shards of it are empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4),
                         nn.Linear(4, 1)).to(dtype)


def data(dtype, t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(8, 8, generator=g, dtype=dtype), torch.randn(8, 1, generator=g, dtype=dtype)


def CountCollectives() -> CountCalls:
    """Counts the collectives issued while active (c10d and functional ones)."""
    return CountCalls(("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                       "broadcast", "all_gather_tensor"))


def _worker(family, kernels=KERNELS, sizes=None, dtypes=(torch.float64, torch.float32),
            picks=None, steps=STEPS):
    """The cases of ``family`` (those at ``picks``, default all) with each of ``kernels``
    and ``dtypes``, ``steps`` steps each; ``sizes`` overrides the Triton kernel's chunk
    sizes here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from bigbatch.optim import _triton_plan

    for name, value in (sizes or {}).items():
        setattr(_triton_plan, name, value)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    results = []
    cases = [(dtype, mode, kernel, cls, kw) for dtype in dtypes
             for mode in ("fsdp", "tp") for kernel in kernels
             for i, (cls, kw) in enumerate(CASES[family]) if picks is None or i in picks]
    for dtype, mode, kernel, cls, kw in cases:
        model = mlp(dtype)
        single = copy.deepcopy(model)
        if mode == "fsdp":
            fully_shard(model[0], mesh=mesh)
            fully_shard(model[2], mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            parallelize_module(model, mesh, {"0": ColwiseParallel(),
                                             "2": RowwiseParallel()})
        assert any(isinstance(p, DTensor) for p in model.parameters())
        opt = cls(model.named_parameters(), exclude=EXCLUDE, kernel=kernel, **kw)
        assert opt._choose_kernel(list(model.parameters())) == (
            "per_tensor" if kernel == "auto" else kernel)
        single_opt = cls(single.named_parameters(), exclude=EXCLUDE,
                         kernel="reference", **kw)
        counts = []
        for t in range(steps):
            x, y = data(dtype, t)
            # FSDP is data parallel: each rank takes half the batch, gradients average.
            xs, ys = (x.chunk(2)[rank], y.chunk(2)[rank]) if mode == "fsdp" else (x, y)
            F.mse_loss(model(xs), ys).backward()
            with CountCollectives() as c:
                opt.step()
            counts.append(c.calls)
            opt.zero_grad()
            F.mse_loss(single(x), y).backward()
            single_opt.step()
            single_opt.zero_grad()
        diffs = {}
        for (name, p), q in zip(model.named_parameters(), single.parameters(),
                                strict=True):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            assert not torch.equal(q, mlp(dtype).state_dict()[name]), name
            diffs[name] = ((full - q).abs().max().item(), q.abs().max().item())
        results.append(dict(mode=mode, dtype=str(dtype), cls=cls.__name__, kw=kw,
                            kernel=kernel, diffs=diffs, counts=counts))
        del model, opt, single, single_opt
    return results


@pytest.fixture(scope="module", params=["LARS", "LAMB"])
def dist_results(request):
    return request.param, run_workers(_worker, world_size=2, args=(request.param,),
                                      timeout=240, init_group=True)


def test_sharded_and_tensor_parallel_equal_single_process(dist_results):
    check_equal_single_process(*dist_results)


def test_one_all_reduce_per_step_for_all_tensors(dist_results):
    check_one_all_reduce_per_step(*dist_results)


def check_equal_single_process(family, per_rank):
    assert len(per_rank) == 2
    for case in per_rank[0]:
        tol = 1e-10 if case["dtype"] == "torch.float64" else 1e-5
        for name, (diff, scale) in case["diffs"].items():
            assert diff <= tol * max(1.0, scale), (family, case["mode"], case["kernel"],
                                                   case["dtype"], case["kw"], name, diff)


def check_one_all_reduce_per_step(family, per_rank):
    for results in per_rank:
        for case in results:
            # TP's LayerNorm is a plain tensor and row-wise biases are replicated: only the
            # sharded tensors are reduced, all in one call. LAMB's clipping adds one.
            expected = 1 + (case["kw"].get("max_grad_norm") is not None)
            assert case["counts"] == [expected] * len(case["counts"]), (family, case["mode"], case["kernel"],
                                                          case["counts"])
