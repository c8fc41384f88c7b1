"""LARS and LAMB: one-step numbers by hand, fast == reference, convergence, resume.

Hand numbers use w = (3, 4) (||w|| = 5) and small gradients, in float64, and
are written as plain arithmetic from the formulas in issue 2 / the module
docstrings, never by calling the code under test.
"""

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.optim import LAMB, LARS

F64 = torch.float64
W = (3.0, 4.0)  # ||W|| = 5
FAST = pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors: intra-op threads only add contention on the shared 2-core box.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    unclipped = 0.1 * 1.0 * 5.0 / (1.0 + 0.1 * 5.0)  # = 1/3 > lr
    local = 0.1 if clip else unclipped
    close(p, (3.0 - local * 0.9, 4.0 - local * 1.2))
    close(opt.trust_ratios(), (local / 0.1,))


@FAST
def test_lars_trust_clip_leaves_small_local_lr(fast):
    p, opt = make(LARS, fast=fast, trust_clip=True, **LARS_KW)
    step(p, opt, G1)
    close(p, (3.0 - 0.003, 4.0 - 0.004))


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


# ---------------------------------------------------------------- scratch buffer


def test_lamb_fast_float32_reuses_one_scratch_buffer():
    model = nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 3), nn.LayerNorm(3))
    opt = LAMB(model.named_parameters(), lr=0.01, exclude=("bias",), fast=True)
    x = torch.randn(8, 6)
    biggest = max(p.numel() for p in model.parameters())
    seen = set()
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert opt._scratch.dtype == torch.float32
        assert opt._scratch.numel() == biggest
        seen.add((id(opt._scratch), opt._scratch.data_ptr()))
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
