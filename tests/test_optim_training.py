"""LARS and LAMB in training: fast == reference, convergence, resume, scratch buffer."""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.optim import LAMB, LARS

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


# ------------------------------------------------- fast path == reference path


def mlp(dtype=F64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batch(dtype=F64, n=16):
    g = torch.Generator().manual_seed(123)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def train(model, opt, steps, x, y, sched=None, lr_change_at=None):
    for t in range(steps):
        if t == lr_change_at:
            for group in opt.param_groups:
                group["lr"] *= 0.3
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


CONFIGS = [
    (LARS, dict(lr=1.0, trust_coefficient=0.02, weight_decay=1e-3)),
    (LARS, dict(lr=1.0, trust_coefficient=0.02, weight_decay=1e-3, nesterov=True)),
    (LARS, dict(lr=0.5, trust_coefficient=0.02, weight_decay=1e-3, momentum=0.0, eps=1e-3)),
    (LARS, dict(lr=1.0, trust_coefficient=0.5, trust_clip=True, always_adapt=True)),
    (LAMB, dict(lr=0.02, max_grad_norm=0.5)),
    (LAMB, dict(lr=0.02, bias_correction=False, eps=1e-3)),
    (LAMB, dict(lr=0.05, trust_clip=True, always_adapt=True, betas=(0.8, 0.9))),
]


@pytest.mark.parametrize(
    "cls,kw",
    CONFIGS,
    ids=lambda c: c.__name__ if isinstance(c, type) else ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_fast_path_matches_reference(cls, kw):
    x, y = batch()
    runs = []
    for fast in (False, True):
        model = mlp()
        opt = cls(model.named_parameters(), exclude=("bias",), fast=fast, **kw)
        train(model, opt, 6, x, y, lr_change_at=3)
        runs.append((model, opt))
    (ref, ref_opt), (fast, fast_opt) = runs
    start = mlp()
    for (name, p), q, p0 in zip(
        ref.named_parameters(), fast.parameters(), start.parameters(), strict=True
    ):
        assert not torch.equal(p, p0), f"{name} did not move"
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14, msg=name)
        # the displacement too, so rounding of w itself cannot hide a difference
        torch.testing.assert_close(q - p0, p - p0, rtol=1e-9, atol=1e-15, msg=name)
    for p, q in zip(ref.parameters(), fast.parameters(), strict=True):
        if cls is LARS:
            torch.testing.assert_close(
                fast_opt.velocity(q), ref_opt.velocity(p), rtol=1e-10, atol=1e-15
            )
        else:
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    fast_opt.state[q][key], ref_opt.state[p][key], rtol=1e-10, atol=1e-15
                )


# ---------------------------------------------------------------- convergence


def xor_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 2, generator=g)
    return x, ((x[:, 0] * x[:, 1]) > 0).long()


@pytest.mark.parametrize("name", ["LARS+LambdaLR", "LAMB+OneCycleLR"])
def test_converges_with_torch_scheduler(name):
    x, y = xor_data()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))
    steps = 80
    if name.startswith("LARS"):
        opt = LARS(
            model.named_parameters(),
            lr=5.0,
            trust_coefficient=0.02,
            weight_decay=1e-4,
            exclude=("bias",),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: min(1.0, (t + 1) / 10) * (1 - t / steps)
        )
        peak = 5.0
    else:
        opt = LAMB(model.named_parameters(), lr=0.05, weight_decay=0.01, exclude=("bias",))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps)
        peak = 0.05
    lrs, losses = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    # the scheduler drove every group's lr: warm up to the peak, then down
    assert lrs[0] < 0.2 * peak and max(lrs) > 0.8 * peak and lrs[-1] < 0.1 * peak
    assert all(g["lr"] == opt.param_groups[0]["lr"] for g in opt.param_groups)
    assert losses[-1] < losses[0] / 5, losses[::10]
    assert (model(x).argmax(1) == y).float().mean() > 0.95


# ---------------------------------------------------------------- state_dict


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
@pytest.mark.parametrize(
    "cls,kw",
    [
        (LARS, dict(lr=1.0, trust_coefficient=0.02, nesterov=False)),
        (LARS, dict(lr=1.0, trust_coefficient=0.02, nesterov=True)),
        (LAMB, dict(lr=0.02, max_grad_norm=1.0)),
    ],
    ids=["LARS", "LARS-nesterov", "LAMB"],
)
def test_state_dict_round_trip_is_bit_identical(cls, kw, fast):
    x, y = batch(torch.float32)

    def build():
        model = mlp(torch.float32)
        opt = cls(model.named_parameters(), exclude=("bias",), fast=fast, **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
        return model, opt, sched

    model, opt, sched = build()
    train(model, opt, 3, x, y, sched)
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf
    )
    train(model, opt, 3, x, y, sched)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2, sched2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.param_groups[0]["lr"] == pytest.approx(1.0 * kw["lr"] / 4)
    train(model2, opt2, 3, x, y, sched2)
    for (name, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------- scratch buffer


def test_lamb_fast_float32_reuses_one_scratch_buffer():
    model = nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 3), nn.LayerNorm(3))
    opt = LAMB(model.named_parameters(), lr=0.01, exclude=("bias",), fast=True)
    x = torch.randn(8, 6)
    # sized for the largest tensor or all the small ones stepped together, whichever is more
    biggest = max(max(p.numel() for p in model.parameters()),
                  sum(p.numel() for p in model.parameters()))
    seen = set()
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert opt._scratch.buffer.dtype == torch.float32
        assert opt._scratch.buffer.numel() == biggest
        seen.add((id(opt._scratch.buffer), opt._scratch.buffer.data_ptr()))
    assert len(seen) == 1
    # no other update-sized tensors hide in the per-parameter state
    for p in model.parameters():
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def test_lamb_fast_float32_step_allocates_nothing_update_sized_after_the_first():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 3))
    opt = LAMB(model.named_parameters(), lr=0.01, exclude=("bias",), max_grad_norm=0.1, fast=True)
    x = torch.randn(8, 64)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        opt.step()
    allocs = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocs, "profiler recorded no allocations at all"  # the few scalar norms
    assert max(allocs) < 1024  # smallest weight: 3 x 256 floats = 3 KiB; biggest 64 KiB
