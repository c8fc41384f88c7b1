"""LARS and LAMB: one-step numbers computed by hand, and trust ratios.

Hand numbers use w = (3, 4) (||w|| = 5) and small gradients, in float64, and
are written as plain arithmetic from the formulas in issue 2 / the module
docstrings, never by calling the code under test.
"""

import math

import pytest
import torch
from torch import nn

from bigbatch.optim import LAMB, LARS

F64 = torch.float64
W = (3.0, 4.0)  # ||W|| = 5
FAST = pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def vec(*xs):
    return torch.tensor(xs, dtype=F64)


def close(actual, expected, rtol=1e-12, atol=1e-15):
    expected = expected if isinstance(expected, torch.Tensor) else vec(*expected)
    torch.testing.assert_close(actual.detach(), expected.to(actual.dtype), rtol=rtol, atol=atol)


def make(cls, w0=W, name=None, **kw):
    p = nn.Parameter(vec(*w0))
    opt = cls([(name, p)] if name else [p], **kw)
    opt.track_trust_ratios = True
    return p, opt


def step(p, opt, grad, lr=None):
    if lr is not None:
        opt.param_groups[0]["lr"] = lr
    p.grad = vec(*grad)
    opt.step()


# ---------------------------------------------------------------- LARS

G1 = (0.6, 0.8)  # ||G1|| = 1
G2 = (0.0, 1.0)  # ||G2|| = 1
LARS_KW = dict(lr=0.1, momentum=0.9, weight_decay=0.1, trust_coefficient=0.01)


@FAST
def test_lars_first_and_second_step(fast):
    p, opt = make(LARS, fast=fast, **LARS_KW)
    step(p, opt, G1)
    local1 = 0.1 * 0.01 * 5.0 / (1.0 + 0.1 * 5.0)  # = 1/300
    v1 = (local1 * (0.6 + 0.1 * 3.0), local1 * (0.8 + 0.1 * 4.0))  # = (0.003, 0.004)
    w1 = (3.0 - v1[0], 4.0 - v1[1])
    close(p, w1)
    close(opt.velocity(p), v1)
    close(opt.trust_ratios(), (local1 / 0.1,))

    step(p, opt, G2)
    n1 = math.hypot(*w1)
    local2 = 0.1 * 0.01 * n1 / (1.0 + 0.1 * n1)
    v2 = (0.9 * v1[0] + local2 * (0.0 + 0.1 * w1[0]), 0.9 * v1[1] + local2 * (1.0 + 0.1 * w1[1]))
    close(opt.velocity(p), v2)
    close(p, (w1[0] - v2[0], w1[1] - v2[1]))
    close(opt.trust_ratios(), (local2 / 0.1,))


@FAST
def test_lars_eps_in_denominator(fast):
    p, opt = make(LARS, fast=fast, eps=0.5, **LARS_KW)
    step(p, opt, G1)
    local = 0.1 * 0.01 * 5.0 / (1.0 + 0.1 * 5.0 + 0.5)  # = 0.0025
    close(p, (3.0 - local * 0.9, 4.0 - local * 1.2))


@FAST
@pytest.mark.parametrize("clip", [False, True])
def test_lars_trust_clip_caps_local_lr_at_lr(fast, clip):
    kw = {**LARS_KW, "trust_coefficient": 1.0}
    p, opt = make(LARS, fast=fast, trust_clip=clip, **kw)
    step(p, opt, G1)
    adaptive = 1.0 * 5.0 / (1.0 + 0.1 * 5.0)  # = 10/3
    # LARC (Ginsburg et al.; apex LARC(clip=True)): local_lr = min(adaptive, lr) = lr here
    local = 0.1 if clip else 0.1 * adaptive
    close(p, (3.0 - local * 0.9, 4.0 - local * 1.2))
    close(opt.trust_ratios(), (local / 0.1,))


@FAST
def test_larc_uses_adaptive_rate_itself_below_lr(fast):
    # LARC's clipping mode does not multiply by lr: local_lr = min(adaptive, lr).
    p, opt = make(LARS, fast=fast, trust_clip=True, **LARS_KW)
    step(p, opt, G1)
    adaptive = 0.01 * 5.0 / (1.0 + 0.1 * 5.0)  # = 1/30 < lr = 0.1
    d = (0.6 + 0.1 * 3.0, 0.8 + 0.1 * 4.0)
    close(p, (3.0 - adaptive * d[0], 4.0 - adaptive * d[1]))  # (2.97, 3.96)
    close(opt.velocity(p), (adaptive * d[0], adaptive * d[1]))
    close(opt.trust_ratios(), (adaptive / 0.1,))


@FAST
def test_larc_lr_caps_as_lr_changes(fast):
    # apex: adaptive_lr = min(adaptive / lr, 1), then the wrapped SGD multiplies by lr.
    p, opt = make(LARS, fast=fast, trust_clip=True, **{**LARS_KW, "momentum": 0.0})
    step(p, opt, G1, lr=0.02)
    adaptive = 0.01 * 5.0 / (1.0 + 0.1 * 5.0)  # 1/30 > lr = 0.02: capped
    w1 = (3.0 - 0.02 * 0.9, 4.0 - 0.02 * 1.2)
    close(p, w1)
    step(p, opt, G2, lr=1.0)
    n1 = math.hypot(*w1)
    adaptive = 0.01 * n1 / (1.0 + 0.1 * n1)  # < lr = 1: used as it is
    close(p, (w1[0] - adaptive * (0.0 + 0.1 * w1[0]), w1[1] - adaptive * (1.0 + 0.1 * w1[1])))


@FAST
@pytest.mark.parametrize("clip", [False, True])
def test_lars_zero_norm_uses_lr_in_both_modes(fast, clip):
    p, opt = make(LARS, w0=(0.0, 0.0), fast=fast, trust_clip=clip, **LARS_KW)
    step(p, opt, G1)
    close(p, (-0.1 * 0.6, -0.1 * 0.8))


def test_lars_default_lr_is_one():
    p = nn.Parameter(vec(*W))
    assert LARS([p]).param_groups[0]["lr"] == 1.0


@FAST
def test_lars_nesterov_two_steps(fast):
    p, opt = make(LARS, fast=fast, nesterov=True, **LARS_KW)
    step(p, opt, G1)
    local1 = 0.1 * 0.01 * 5.0 / (1.0 + 0.1 * 5.0)
    d1 = (0.6 + 0.1 * 3.0, 0.8 + 0.1 * 4.0)
    v1 = (local1 * d1[0], local1 * d1[1])
    w1 = (3.0 - (0.9 * v1[0] + local1 * d1[0]), 4.0 - (0.9 * v1[1] + local1 * d1[1]))
    close(p, w1)
    close(opt.velocity(p), v1)

    step(p, opt, G2)
    n1 = math.hypot(*w1)
    local2 = 0.1 * 0.01 * n1 / (1.0 + 0.1 * n1)
    d2 = (0.0 + 0.1 * w1[0], 1.0 + 0.1 * w1[1])
    v2 = (0.9 * v1[0] + local2 * d2[0], 0.9 * v1[1] + local2 * d2[1])
    close(opt.velocity(p), v2)
    close(p, (w1[0] - (0.9 * v2[0] + local2 * d2[0]), w1[1] - (0.9 * v2[1] + local2 * d2[1])))


@FAST
def test_lars_zero_weight_norm_uses_lr(fast):
    p, opt = make(LARS, w0=(0.0, 0.0), fast=fast, **LARS_KW)
    step(p, opt, G1)
    # local_lr = lr; d = g + wd * 0: a zero-initialised layer still moves.
    close(p, (-0.1 * 0.6, -0.1 * 0.8))
    close(opt.trust_ratios(), (1.0,))


@FAST
def test_lars_zero_grad_norm_uses_lr(fast):
    p, opt = make(LARS, fast=fast, **LARS_KW)
    step(p, opt, (0.0, 0.0))
    # local_lr = lr; d = 0 + wd * w.
    close(p, (3.0 - 0.1 * 0.1 * 3.0, 4.0 - 0.1 * 0.1 * 4.0))
    close(opt.trust_ratios(), (1.0,))


@FAST
def test_lars_excluded_param_is_plain_momentum_sgd(fast):
    p, opt = make(LARS, name="fc.bias", exclude=("bias",), fast=fast, **LARS_KW)
    step(p, opt, G1)
    v1 = (0.1 * 0.6, 0.1 * 0.8)  # no ratio, no weight decay
    w1 = (3.0 - v1[0], 4.0 - v1[1])
    close(p, w1)
    step(p, opt, G2)
    v2 = (0.9 * v1[0] + 0.1 * 0.0, 0.9 * v1[1] + 0.1 * 1.0)
    close(p, (w1[0] - v2[0], w1[1] - v2[1]))
    close(opt.velocity(p), v2)
    close(opt.trust_ratios(), (1.0,))
    # ... which is exactly torch's momentum SGD.
    q = nn.Parameter(vec(*W))
    sgd = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    for g in (G1, G2):
        q.grad = vec(*g)
        sgd.step()
    close(p, q)


@FAST
def test_lars_always_adapt_keeps_ratio_without_decay(fast):
    p, opt = make(LARS, name="fc.bias", exclude=("bias",), always_adapt=True, fast=fast, **LARS_KW)
    step(p, opt, G1)
    local = 0.1 * 0.01 * 5.0 / (1.0 + 0.0 * 5.0)  # = 0.005: ratio kept, weight decay 0
    close(p, (3.0 - local * 0.6, 4.0 - local * 0.8))
    close(opt.trust_ratios(), (local / 0.1,))


@FAST
def test_lars_velocity_in_fleet_units_across_lr_changes(fast):
    p, opt = make(LARS, fast=fast, **LARS_KW)
    step(p, opt, G1, lr=0.1)
    v1 = (0.003, 0.004)
    w1 = (3.0 - 0.003, 4.0 - 0.004)
    step(p, opt, G2, lr=0.05)
    n1 = math.hypot(*w1)
    local2 = 0.05 * 0.01 * n1 / (1.0 + 0.1 * n1)
    v2 = (0.9 * v1[0] + local2 * (0.0 + 0.1 * w1[0]), 0.9 * v1[1] + local2 * (1.0 + 0.1 * w1[1]))
    w2 = (w1[0] - v2[0], w1[1] - v2[1])
    close(opt.velocity(p), v2)
    close(p, w2)
    step(p, opt, G1, lr=0.2)
    n2 = math.hypot(*w2)
    local3 = 0.2 * 0.01 * n2 / (1.0 + 0.1 * n2)
    v3 = (0.9 * v2[0] + local3 * (0.6 + 0.1 * w2[0]), 0.9 * v2[1] + local3 * (0.8 + 0.1 * w2[1]))
    close(opt.velocity(p), v3)
    close(p, (w2[0] - v3[0], w2[1] - v3[1]))


@FAST
@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_lr_zero_step_decays_velocity(fast, nesterov):
    p, opt = make(LARS, fast=fast, nesterov=nesterov, **LARS_KW)
    mu, local1 = 0.9, 0.1 * 0.01 * 5.0 / (1.0 + 0.1 * 5.0)
    d1 = (0.9, 1.2)
    v1 = (local1 * d1[0], local1 * d1[1])
    # nesterov: w -= mu * v + local_lr * d; plain: w -= v.
    s1 = (mu * v1[0] + local1 * d1[0], mu * v1[1] + local1 * d1[1]) if nesterov else v1
    w1 = (3.0 - s1[0], 4.0 - s1[1])
    step(p, opt, G1, lr=0.1)
    close(p, w1)

    step(p, opt, G2, lr=0.0)  # local_lr = 0: v = mu * v
    v2 = (mu * v1[0], mu * v1[1])
    s2 = (mu * v2[0], mu * v2[1]) if nesterov else v2
    w2 = (w1[0] - s2[0], w1[1] - s2[1])
    close(opt.velocity(p), v2)
    close(p, w2)
    assert torch.isfinite(opt.trust_ratios()).all()

    step(p, opt, G1, lr=0.1)
    n2 = math.hypot(*w2)
    local3 = 0.1 * 0.01 * n2 / (1.0 + 0.1 * n2)
    d3 = (0.6 + 0.1 * w2[0], 0.8 + 0.1 * w2[1])
    v3 = (mu * v2[0] + local3 * d3[0], mu * v2[1] + local3 * d3[1])
    s3 = (mu * v3[0] + local3 * d3[0], mu * v3[1] + local3 * d3[1]) if nesterov else v3
    close(opt.velocity(p), v3)
    close(p, (w2[0] - s3[0], w2[1] - s3[1]))


@FAST
def test_lars_lr_zero_first_step_then_normal(fast):
    p, opt = make(LARS, fast=fast, **LARS_KW)
    step(p, opt, G1, lr=0.0)  # warmup from zero
    close(p, W)
    close(opt.velocity(p), (0.0, 0.0))
    step(p, opt, G1, lr=0.1)
    close(p, (3.0 - 0.003, 4.0 - 0.004))


@FAST
def test_lars_momentum_zero(fast):
    p, opt = make(LARS, fast=fast, **{**LARS_KW, "momentum": 0.0})
    step(p, opt, G1)
    w1 = (3.0 - 0.003, 4.0 - 0.004)
    step(p, opt, G2)
    n1 = math.hypot(*w1)
    local2 = 0.1 * 0.01 * n1 / (1.0 + 0.1 * n1)
    close(p, (w1[0] - local2 * 0.1 * w1[0], w1[1] - local2 * (1.0 + 0.1 * w1[1])))


# ---------------------------------------------------------------- LAMB

H1 = (0.6, -0.8)
H2 = (0.2, 0.4)
LAMB_KW = dict(lr=0.01, betas=(0.5, 0.75), eps=0.1, weight_decay=0.1)


@FAST
def test_lamb_first_and_second_step(fast):
    p, opt = make(LAMB, fast=fast, **LAMB_KW)
    step(p, opt, H1)
    m1 = (0.5 * 0.6, 0.5 * -0.8)
    v1 = (0.25 * 0.6**2, 0.25 * 0.8**2)
    mh = (m1[0] / (1 - 0.5), m1[1] / (1 - 0.5))
    vh = (v1[0] / (1 - 0.75), v1[1] / (1 - 0.75))
    r1 = (mh[0] / (math.sqrt(vh[0]) + 0.1), mh[1] / (math.sqrt(vh[1]) + 0.1))  # 0.6/0.7, -0.8/0.9
    u1 = (r1[0] + 0.1 * 3.0, r1[1] + 0.1 * 4.0)
    ratio1 = 5.0 / math.hypot(*u1)
    w1 = (3.0 - 0.01 * ratio1 * u1[0], 4.0 - 0.01 * ratio1 * u1[1])
    close(opt.state[p]["exp_avg"], m1)
    close(opt.state[p]["exp_avg_sq"], v1)
    close(p, w1)
    close(opt.trust_ratios(), (ratio1,))

    step(p, opt, H2)
    m2 = (0.5 * m1[0] + 0.5 * 0.2, 0.5 * m1[1] + 0.5 * 0.4)
    v2 = (0.75 * v1[0] + 0.25 * 0.2**2, 0.75 * v1[1] + 0.25 * 0.4**2)
    r2 = tuple((m2[i] / (1 - 0.5**2)) / (math.sqrt(v2[i] / (1 - 0.75**2)) + 0.1) for i in range(2))
    u2 = (r2[0] + 0.1 * w1[0], r2[1] + 0.1 * w1[1])
    ratio2 = math.hypot(*w1) / math.hypot(*u2)
    close(opt.state[p]["exp_avg"], m2)
    close(opt.state[p]["exp_avg_sq"], v2)
    close(p, (w1[0] - 0.01 * ratio2 * u2[0], w1[1] - 0.01 * ratio2 * u2[1]))
    close(opt.trust_ratios(), (ratio2,))


@FAST
def test_lamb_without_bias_correction(fast):
    p, opt = make(LAMB, fast=fast, bias_correction=False, **LAMB_KW)
    step(p, opt, H1)
    r1 = (0.3 / (math.sqrt(0.09) + 0.1), -0.4 / (math.sqrt(0.16) + 0.1))  # (0.75, -0.8)
    u1 = (r1[0] + 0.3, r1[1] + 0.4)
    ratio1 = 5.0 / math.hypot(*u1)
    w1 = (3.0 - 0.01 * ratio1 * u1[0], 4.0 - 0.01 * ratio1 * u1[1])
    close(p, w1)
    step(p, opt, H2)
    m2 = (0.5 * 0.3 + 0.5 * 0.2, 0.5 * -0.4 + 0.5 * 0.4)
    v2 = (0.75 * 0.09 + 0.25 * 0.04, 0.75 * 0.16 + 0.25 * 0.16)
    r2 = (m2[0] / (math.sqrt(v2[0]) + 0.1), m2[1] / (math.sqrt(v2[1]) + 0.1))
    u2 = (r2[0] + 0.1 * w1[0], r2[1] + 0.1 * w1[1])
    ratio2 = math.hypot(*w1) / math.hypot(*u2)
    close(p, (w1[0] - 0.01 * ratio2 * u2[0], w1[1] - 0.01 * ratio2 * u2[1]))


R1 = (0.6 / (0.6 + 0.1), -0.8 / (0.8 + 0.1))  # first bias-corrected step direction for H1


@FAST
def test_lamb_zero_weight_norm_ratio_one(fast):
    p, opt = make(LAMB, w0=(0.0, 0.0), fast=fast, **LAMB_KW)
    step(p, opt, H1)
    close(p, (-0.01 * R1[0], -0.01 * R1[1]))
    close(opt.trust_ratios(), (1.0,))


@FAST
def test_lamb_zero_update_norm_ratio_one(fast):
    p, opt = make(LAMB, fast=fast, **{**LAMB_KW, "weight_decay": 0.0})
    step(p, opt, (0.0, 0.0))  # r = 0 and no decay: u = 0
    close(p, W)
    close(opt.trust_ratios(), (1.0,))


@FAST
def test_lamb_zero_grad_decay_only(fast):
    p, opt = make(LAMB, fast=fast, **LAMB_KW)
    step(p, opt, (0.0, 0.0))  # u = 0.1 * w, ratio = ||w|| / ||0.1 w|| = 10
    close(p, (3.0 - 0.01 * 10.0 * 0.3, 4.0 - 0.01 * 10.0 * 0.4))
    close(opt.trust_ratios(), (10.0,))


@FAST
def test_lamb_excluded_param_is_adam_without_decay(fast):
    p, opt = make(LAMB, name="norm.weight", exclude=("norm",), fast=fast, **LAMB_KW)
    step(p, opt, H1)
    w1 = (3.0 - 0.01 * R1[0], 4.0 - 0.01 * R1[1])
    close(p, w1)
    close(opt.trust_ratios(), (1.0,))
    step(p, opt, H2)
    q = nn.Parameter(vec(*W))
    adam = torch.optim.Adam([q], lr=0.01, betas=(0.5, 0.75), eps=0.1)
    for g in (H1, H2):
        q.grad = vec(*g)
        adam.step()
    close(p, q)


@FAST
def test_lamb_always_adapt_keeps_ratio_without_decay(fast):
    p, opt = make(
        LAMB, name="norm.weight", exclude=("norm",), always_adapt=True, fast=fast, **LAMB_KW
    )
    step(p, opt, H1)
    ratio = 5.0 / math.hypot(*R1)  # u = r: weight decay 0, ratio kept
    close(p, (3.0 - 0.01 * ratio * R1[0], 4.0 - 0.01 * ratio * R1[1]))
    close(opt.trust_ratios(), (ratio,))


@FAST
@pytest.mark.parametrize("clip", [False, True])
def test_lamb_trust_clip_caps_ratio_at_one(fast, clip):
    p, opt = make(LAMB, fast=fast, trust_clip=clip, **LAMB_KW)
    step(p, opt, H1)
    u1 = (R1[0] + 0.3, R1[1] + 0.4)
    raw = 5.0 / math.hypot(*u1)
    assert raw > 1.5  # so the cap matters
    ratio = 1.0 if clip else raw
    close(p, (3.0 - 0.01 * ratio * u1[0], 4.0 - 0.01 * ratio * u1[1]))
    close(opt.trust_ratios(), (ratio,))


@FAST
@pytest.mark.parametrize("max_norm", [2.5, 5.0, 10.0])
def test_lamb_max_grad_norm_is_global_over_groups(fast, max_norm):
    a = nn.Parameter(vec(3.0, 4.0))
    b = nn.Parameter(vec(1.0, 2.0))
    opt = LAMB(
        [{"params": [("a.weight", a)]}, {"params": [("b.bias", b)], "lr": 0.02}],
        exclude=("bias",),
        max_grad_norm=max_norm,
        fast=fast,
        **LAMB_KW,
    )
    a.grad, b.grad = vec(3.0, 0.0), vec(0.0, 4.0)  # global norm 5
    opt.step()
    div = 5.0 / max_norm if max_norm < 5.0 else 1.0
    ga, gb = (3.0 / div, 0.0), (0.0, 4.0 / div)
    close(a.grad, ga)
    close(b.grad, gb)
    close(opt.state[a]["exp_avg"], (0.5 * ga[0], 0.0))
    close(opt.state[b]["exp_avg"], (0.0, 0.5 * gb[1]))
    # b: excluded Adam step at its group's lr, with the clipped gradient.
    close(b, (1.0, 2.0 - 0.02 * gb[1] / (gb[1] + 0.1)))
    ua = (ga[0] / (ga[0] + 0.1) + 0.3, 0.0 + 0.4)
    ratio = 5.0 / math.hypot(*ua)
    close(a, (3.0 - 0.01 * ratio * ua[0], 4.0 - 0.01 * ratio * ua[1]))


# ---------------------------------------------------------------- trust ratios


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_trust_ratios_off_by_default(cls):
    p = nn.Parameter(vec(*W))
    opt = cls([p], lr=0.1)
    p.grad = vec(*G1)
    opt.step()
    assert opt.trust_ratios() is None


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_trust_ratios_none_again_after_switching_off(cls):
    p = nn.Parameter(vec(*W))
    opt = cls([p], lr=0.1)
    opt.track_trust_ratios = True
    p.grad = vec(*G1)
    opt.step()
    assert opt.trust_ratios() is not None
    opt.track_trust_ratios = False
    opt.step()
    assert opt.trust_ratios() is None  # not the stale ratios of an earlier step


def three_params():
    return [
        ("fc.weight", nn.Parameter(vec(*W))),
        ("fc.bias", nn.Parameter(vec(1.0, 0.0))),
        ("head.weight", nn.Parameter(vec(0.5, 0.5))),
    ]


def test_trust_ratios_lars_one_per_param_with_grad():
    named = three_params()
    opt = LARS(named, exclude=("bias",), **LARS_KW)
    opt.track_trust_ratios = True
    named[0][1].grad, named[1][1].grad = vec(*G1), vec(0.3, 0.4)  # head.weight: no grad
    opt.step()
    ratios = opt.trust_ratios()
    assert ratios.ndim == 1 and ratios.dtype.is_floating_point
    assert ratios.shape == (2,)
    local = 0.1 * 0.01 * 5.0 / (1.0 + 0.1 * 5.0)
    close(ratios, (local / 0.1, 1.0))  # fc.weight, then the excluded fc.bias
    assert opt.param_names() == ["fc.weight", "head.weight", "fc.bias"]


def test_trust_ratios_lamb_one_per_param_with_grad():
    named = three_params()
    opt = LAMB(named, exclude=("bias",), **LAMB_KW)
    opt.track_trust_ratios = True
    for _, p in named:
        p.grad = vec(*H1)
    opt.step()
    ratios = opt.trust_ratios()
    assert ratios.shape == (3,)
    u_fc = (R1[0] + 0.3, R1[1] + 0.4)
    u_head = (R1[0] + 0.05, R1[1] + 0.05)
    close(ratios, (5.0 / math.hypot(*u_fc), math.hypot(0.5, 0.5) / math.hypot(*u_head), 1.0))
