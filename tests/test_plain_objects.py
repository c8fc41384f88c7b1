"""bigbatch's pieces as plain PyTorch objects for any loop or trainer: the strategy's
optimizer (`build_optimizer`), its schedule as a torch `LRScheduler` that counts
optimizer steps (`ScheduleLR`, `build_scheduler`), the LR range test without `prepare`,
and the noise scale from two gradients of any loop."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch import GradientNoiseScale, Schedule, ScheduleLR, build_optimizer, build_scheduler
from bigbatch.optim import LAMB, LARS

TOML = """
[batch]
base_lr = 0.01
base_batch_size = 32
micro_batch_size = 64
warmup_steps = 3
decay = "cosine"

[optimizer]
type = "adamw"

[lamb]
enable = true
"""


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def test_build_optimizer_is_the_strategys_at_its_peak_lr():
    m = model()
    opt = build_optimizer(m, TOML)
    assert isinstance(opt, LAMB)
    plan = bigbatch.Strategy.from_toml(TOML).resolve(1)
    assert plan.peak_lr == pytest.approx(0.02)  # linear rule, batch 64 over base 32
    assert {g["lr"] for g in opt.param_groups} == {plan.peak_lr}
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(m[0].weight), id(m[2].weight)}
    assert build_optimizer(m, TOML, lr=0.5).param_groups[0]["lr"] == 0.5
    with pytest.raises(TypeError, match="expected a bigbatch.Strategy"):
        build_optimizer(m, 3)


def _lrs(opt, sched, steps, calls_per_step=1, every=1):
    out = []
    for t in range(steps):
        opt.step()
        if (t + 1) % every == 0:
            for _ in range(calls_per_step):
                sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_schedule_lr_counts_optimizer_steps_not_calls():
    """Accelerate steps a scheduler once per process: on 2 ranks a LambdaLR ran its
    schedule twice as fast. Here extra calls change nothing (one warning), and a
    scheduler stepped every other optimizer step catches up."""
    m = model()
    schedule = Schedule(peak_lr=0.1, total_steps=8, warmup_steps=2, decay="cosine")
    expected = [schedule.lr(t + 1) for t in range(8)]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = ScheduleLR(opt, schedule)
    assert opt.param_groups[0]["lr"] == schedule.lr(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _lrs(opt, sched, 8, calls_per_step=2) == pytest.approx(expected)
    assert sum("no optimizer step since the last call" in str(w.message)
               for w in caught) == 1
    assert sched.extra_calls == 8 and sched.last_epoch == 8
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = ScheduleLR(opt, schedule.factor)  # any function of the step
    assert _lrs(opt, sched, 8, every=2)[1::2] == pytest.approx(expected[1::2])


def test_schedule_lr_state_dict_is_plain_data_and_resumes():
    m = model()
    schedule = Schedule(peak_lr=0.1, total_steps=10, warmup_steps=3, decay="poly")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = ScheduleLR(opt, schedule)
    whole = _lrs(opt, sched, 10)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = ScheduleLR(opt, schedule)
    first = _lrs(opt, sched, 4)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    opt2 = torch.optim.SGD(m.parameters(), lr=0.1)
    sched2 = ScheduleLR(opt2, schedule)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert first + _lrs(opt2, sched2, 6) == pytest.approx(whole)


def test_build_scheduler_follows_the_strategy():
    m = model()
    opt = build_optimizer(m, TOML)
    sched = build_scheduler(opt, TOML, total_steps=10)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    s = bigbatch.Strategy.from_toml(TOML)
    schedule = Schedule.from_strategy(s, s.resolve(1), 10)
    assert _lrs(opt, sched, 10) == pytest.approx([schedule.lr(t + 1) for t in range(10)])


def _regression_batches(n=200):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 1, generator=g)
    for _ in range(n):
        x = torch.randn(64, 4, generator=g)
        yield x, x @ w + 0.01 * torch.randn(64, 1, generator=g)


def _mse(m, batch):
    x, y = batch
    return nn.functional.mse_loss(m(x), y)


@pytest.mark.parametrize("how", ["strategy", "optimizer"])
def test_lr_find_without_prepare(how):
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    given = TOML if how == "strategy" else LARS(m.named_parameters(), lr=1.0)
    result = bigbatch.lr_find(m, _mse, _regression_batches(), given, lr_min=1e-4, lr_max=10.0,
                              steps=60)
    assert len(result.lrs) >= 10
    assert result.lrs[0] == pytest.approx(1e-4)
    assert result.suggested_lr is not None, result.reason
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # restored
    if how == "strategy":
        assert result.global_batch_size == 64 and result.base_batch_size == 32
        assert "at global batch 64" in result.summary()


def test_noise_scale_from_any_loop_finds_the_known_value():
    """Loss 0.5 |w - x|^2 with x ~ N(mu, s^2 I_d): the per-example gradient is w - x, so
    |G|^2 = |w - mu|^2 and tr(Sigma) = d s^2. A micro-batch of 4 out of a batch of 64."""
    d, s = 16, 0.5
    w = nn.Parameter(torch.zeros(d, dtype=torch.float64))
    mu = torch.full((d,), 0.25, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    gns = GradientNoiseScale(beta=0.998)
    for _ in range(1500):
        x = mu + s * torch.randn(64, d, generator=g, dtype=torch.float64)
        w.grad = None
        (0.5 * (w - x[:4]).square().sum(1).mean()).backward()
        micro = [w.grad.clone()]
        w.grad = None
        (0.5 * (w - x).square().sum(1).mean()).backward()
        gns.update_from_grads(micro, [w], 4, 64)  # a parameter stands for its .grad
    truth = d * s**2 / (d * 0.25**2)
    assert gns.b_simple == pytest.approx(truth, rel=0.15)
    with pytest.raises(ValueError, match="no gradients given"):
        gns.update_from_grads([None], [w.grad], 4, 64)
