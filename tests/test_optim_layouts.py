"""The optimizers used alone, outside `prepare`, under any DTensor layout and under
`torch.compile`.

A user's own tensor-parallel plan (torch's `parallelize_module`, torchtitan's Llama
shape: a vocabulary-split embedding whose gradient comes back replicated while its
weight is sharded) trains with LAMB and LARS on every CPU kernel and equals one process;
a gradient that cannot fit its parameter is named; a compiled step equals the eager one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _dist import run_workers
from torch import nn

from bigbatch.optim import LAMB, LARS, Muon

KERNELS = ("reference", "per_tensor", "multi_tensor")
CASES = [(LAMB, dict(lr=0.02, weight_decay=0.01)),
         (LARS, dict(lr=0.5, trust_coefficient=0.02, weight_decay=1e-3))]
STEPS = 3


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8),
                         nn.Linear(8, 16)).double()


def tokens(t: int) -> torch.Tensor:
    return torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(t))


def loss_of(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, 16), x.roll(1, 1).reshape(-1))


def _tp_worker():
    """Each (optimizer, kernel) on a user-parallelised model against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    worst = {}
    for cls, kw in CASES:
        for kernel in KERNELS:
            model = tiny_lm()
            single = copy.deepcopy(model)
            # torchtitan's plan for Llama's embedding and head, without sequence parallelism.
            parallelize_module(model, mesh, {
                "0": RowwiseParallel(input_layouts=Replicate()),
                "1": ColwiseParallel(), "3": RowwiseParallel(),
                "4": ColwiseParallel(output_layouts=Replicate())})
            opt = cls(model.named_parameters(), kernel=kernel, **kw)
            ref = cls(single.named_parameters(), kernel="reference", **kw)
            for t in range(STEPS):
                x = tokens(t)
                loss_of(model(x), x).backward()
                assert model[0].weight.grad.placements != model[0].weight.placements
                opt.step()
                opt.zero_grad()
                loss_of(single(x), x).backward()
                ref.step()
                ref.zero_grad()
            worst[f"{cls.__name__}/{kernel}"] = max(
                ((p.full_tensor() if isinstance(p, DTensor) else p) - q).abs().max().item()
                for p, q in zip(model.parameters(), single.parameters(), strict=True))
    # A gradient that cannot be laid out as its parameter is named, by each optimizer.
    for cls in (LAMB, LARS, Muon):
        model = tiny_lm()
        parallelize_module(model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
        opt = cls(model.named_parameters(), lr=0.1)
        x = tokens(0)
        loss_of(model(x), x).backward()
        model[1].weight.grad = model[1].weight.grad.full_tensor()
        try:
            opt.step()
        except RuntimeError as e:
            worst[f"{cls.__name__} misfit"] = str(e)
    return worst


def test_own_tensor_parallel_plan_with_vocabulary_split_embedding_equals_one_process():
    per_rank = run_workers(_tp_worker, world_size=2, timeout=120, init_group=True)
    for worst in per_rank:
        assert set(worst) == {f"{c.__name__}/{k}" for c, _ in CASES for k in KERNELS} | {
            f"{c} misfit" for c in ("LAMB", "LARS", "Muon")}
        for case, diff in worst.items():
            if case.endswith("misfit"):
                assert diff.startswith("the gradient of 1.weight (Tensor of shape (12, 8)) "
                                       "does not match the parameter (DTensor of shape "
                                       "(12, 8))"), diff
            else:
                assert diff < 1e-10, (case, diff)


@pytest.mark.parametrize("cls,kernel", [(LARS, "reference"), (LARS, "per_tensor"),
                                        (LAMB, "multi_tensor"), (LAMB, "auto"),
                                        (Muon, "auto")])
def test_a_compiled_step_equals_the_eager_one(cls, kernel):
    """Before: LARS's reference kernel compiled into other weights, silently; the fused
    CPU kernels failed in Inductor."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = copy.deepcopy(eager)
    opts = [cls(m.named_parameters(), lr=0.1, kernel=kernel) for m in (eager, compiled)]
    steps = [opts[0].step, torch.compile(opts[1].step)]
    for t in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(t))
        for model, opt, step in zip((eager, compiled), opts, steps, strict=True):
            opt.zero_grad()
            model(x).square().sum().backward()
            step()
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(p, q)
