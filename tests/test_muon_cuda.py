"""Muon on CUDA (marked ``cuda``; skipped without a device): the batched bfloat16
Newton-Schulz step makes no host synchronisation, and it lands near the float32 reference
step (bfloat16's rounding, as the published implementations run it)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bigbatch.optim import Muon, muon_param_groups

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32),
                         nn.Linear(32, 96), nn.LayerNorm(96), nn.Linear(96, 64)).cuda()


def _step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    m(x).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_a_step_never_syncs_with_the_host(kernel):
    """Neither kernel reads the device: the batched bfloat16 one, nor the per-matrix
    float32 reference with its unfused AdamW (bias corrections as device tensors)."""
    m = model()
    opt = Muon(muon_param_groups(m, 0.1, adamw=("6.",)), lr=1e-3, kernel=kernel)
    x = torch.randint(0, 64, (8, 4), device="cuda")
    _step(m, opt, x)  # state created
    torch.cuda.synchronize()
    m(x).square().mean().backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_bf16_newton_schulz_lands_near_the_float32_reference():
    """bfloat16's rounding moves one orthogonalisation 2-3.5% from float32's on these
    shapes (`newton_schulz(g, dtype=torch.bfloat16)` against float32 on CPU); three
    steps with momentum stay within 10% of the reference's own movement. A wrong
    coefficient, transpose or scale moves it by far more."""
    fast, ref = model(), model()
    x = torch.randint(0, 64, (8, 4), device="cuda")
    opts = [Muon(muon_param_groups(fast, 0.1, adamw=("6.",)), lr=1e-2),
            Muon(muon_param_groups(ref, 0.1, adamw=("6.",)), lr=1e-2, kernel="reference")]
    start = copy.deepcopy(ref.state_dict())
    for _ in range(3):
        _step(fast, opts[0], x)
        _step(ref, opts[1], x)
    for (name, a), b in zip(fast.named_parameters(), ref.parameters(), strict=True):
        moved = (b - start[name]).norm()
        assert (a - b).norm() <= 0.1 * moved + 1e-6, name


@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_overflow_flag_skips_on_the_device(flag):
    """GradScaler's ``found_inf`` as a CUDA tensor: the step makes no host sync, a set
    flag (gradients inf, as after an overflow) leaves weights and state as they were, a
    zero flag gives the step without one."""
    nets = [model(), model()]
    opts = [Muon(muon_param_groups(m, 0.1, adamw=("6.",)), lr=1e-2) for m in nets]
    x = torch.randint(0, 64, (8, 4), device="cuda")
    for m, opt in zip(nets, opts, strict=True):
        _step(m, opt, x)  # state created
        opt.zero_grad()
        m(x).square().mean().backward()
    before = copy.deepcopy((nets[0].state_dict(), opts[0].state_dict()))
    if flag:
        for p in nets[0].parameters():
            p.grad.fill_(float("inf"))
    opts[0].found_inf = torch.tensor(flag, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opts[0].step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    del opts[0].found_inf
    opts[1].step()
    expected = before if flag else (nets[1].state_dict(), opts[1].state_dict())
    torch.testing.assert_close(nets[0].state_dict(), expected[0], rtol=0, atol=0)
    torch.testing.assert_close(opts[0].state_dict()["state"], expected[1]["state"],
                               rtol=0, atol=0)
