"""The fast kernels equal the reference kernel: every memory layout, every option.

float64, several steps, tight tolerances. Gradients are drawn from a seeded
generator (not from the parameters), so every kernel sees the same numbers.
"""

import io

import pytest
import torch
from torch import nn

from bigbatch.optim import LAMB, LARS

F64 = torch.float64
FAST_KERNELS = ["per_tensor", "multi_tensor"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def make_layout(layout: str, seed: int = 0) -> nn.Parameter:
    """A float64 parameter with the given memory layout (values independent of layout)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return nn.Parameter(torch.randn(6, 10, generator=g, dtype=F64))
    if layout == "transposed":
        return nn.Parameter(torch.randn(10, 6, generator=g, dtype=F64).t())
    if layout == "channels_last":
        w = torch.randn(4, 3, 3, 5, generator=g, dtype=F64)
        return nn.Parameter(w.to(memory_format=torch.channels_last))
    if layout == "non_dense":  # a strided view with gaps
        return nn.Parameter(torch.randn(6, 20, generator=g, dtype=F64)[:, ::2])
    raise ValueError(layout)


LAYOUTS = ["contiguous", "transposed", "channels_last", "non_dense"]


def grads_like(params, step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1 for p in params]


def set_grad(p, g, grad_layout):
    if grad_layout == "like_param":
        p.grad = torch.empty_like(p).copy_(g)  # what autograd gives a dense parameter
    else:
        p.grad = g.contiguous()


LAYOUT_CONFIGS = [
    (LARS, dict(lr=1.0, trust_coefficient=0.02, weight_decay=1e-3)),
    (LARS, dict(lr=1.0, trust_coefficient=0.02, weight_decay=1e-3, nesterov=True)),
    (LAMB, dict(lr=0.02, weight_decay=0.01)),
]


@pytest.mark.parametrize("kernel", FAST_KERNELS)
@pytest.mark.parametrize("grad_layout", ["like_param", "contiguous"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cls,kw", LAYOUT_CONFIGS, ids=["LARS", "LARS-nesterov", "LAMB"])
def test_every_layout_matches_reference(cls, kw, layout, grad_layout, kernel):
    runs = []
    for k in ("reference", kernel):
        p = make_layout(layout)
        strides = p.stride()
        opt = cls([p], kernel=k, **kw)
        for t in range(5):
            set_grad(p, grads_like([p], t)[0], grad_layout)
            opt.step()
        assert p.stride() == strides  # the step never re-lays out the parameter
        runs.append((p.detach().clone(), opt, p))
    (ref, ref_opt, rp), (fast, fast_opt, fp) = runs
    start = make_layout(layout).detach()
    assert not torch.equal(ref, start)
    torch.testing.assert_close(fast - start, ref - start, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-15)
    for key, value in ref_opt.state[rp].items():
        if isinstance(value, torch.Tensor) and value.ndim:
            torch.testing.assert_close(fast_opt.state[fp][key], value, rtol=1e-11, atol=1e-15)


# ------------------------------------------------ every option, multi-tensor == reference


def named_params():
    """A weight, a bias (excluded), a zero-initialised weight, and a weight with zero grads."""
    g = torch.Generator().manual_seed(7)
    return [
        ("fc.weight", nn.Parameter(torch.randn(5, 4, generator=g, dtype=F64))),
        ("fc.bias", nn.Parameter(torch.randn(5, generator=g, dtype=F64))),
        ("zero.weight", nn.Parameter(torch.zeros(3, 4, dtype=F64))),
        ("frozen.weight", nn.Parameter(torch.randn(2, 3, generator=g, dtype=F64))),
    ]


LRS = [0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0]  # warmup from lr = 0, and a zero step midway
STEPS = 7


def run(cls, kw, kernel, steps=STEPS, named=None, opt=None):
    named = named or named_params()
    params = [p for _, p in named]
    opt = opt or cls(named, exclude=("bias",), kernel=kernel, **kw)
    opt.track_trust_ratios = True
    base = [g["lr"] for g in opt.param_groups]
    ratios = []
    for t in range(steps):
        for group, lr0 in zip(opt.param_groups, base, strict=True):
            group["lr"] = lr0 * LRS[t % len(LRS)]
        for (name, p), g in zip(named, grads_like(params, t), strict=True):
            p.grad = torch.zeros_like(p) if name.startswith("frozen") else g
        opt.step()
        ratios.append(opt.trust_ratios())
    return named, opt, ratios


OPTION_CONFIGS = [
    (LARS, dict(lr=0.5, trust_coefficient=0.05, weight_decay=1e-2)),
    (LARS, dict(lr=0.5, trust_coefficient=0.05, weight_decay=1e-2, nesterov=True)),
    (LARS, dict(lr=0.5, trust_coefficient=0.05, weight_decay=0.0, eps=1e-3,
                always_adapt=True)),  # weight decay 0 alone: no trust ratio
    (LARS, dict(lr=0.5, trust_coefficient=0.05, momentum=0.0)),
    (LARS, dict(lr=0.2, trust_coefficient=1.0, trust_clip=True, always_adapt=True)),
    (LARS, dict(lr=0.5, trust_coefficient=0.01, trust_clip=True, nesterov=True)),
    (LAMB, dict(lr=0.05, weight_decay=0.01)),
    (LAMB, dict(lr=0.05, weight_decay=0.0, max_grad_norm=0.3)),
    (LAMB, dict(lr=0.05, max_grad_norm=100.0)),
    (LAMB, dict(lr=0.05, bias_correction=False, eps=1e-3)),
    (LAMB, dict(lr=0.05, trust_clip=True, always_adapt=True, betas=(0.8, 0.9))),
]


def config_id(c):
    if isinstance(c, type):
        return c.__name__
    return ",".join(f"{k}={v}" for k, v in c.items())


def assert_same(named_a, opt_a, named_b, opt_b, rtol=1e-12):
    start = dict(named_params())
    for (name, p), (_, q) in zip(named_a, named_b, strict=True):
        torch.testing.assert_close(q - start[name], p - start[name], rtol=rtol, atol=1e-15,
                                   msg=name)
        for key, value in opt_a.state[p].items():
            other = opt_b.state[q][key]
            torch.testing.assert_close(torch.as_tensor(other).to(F64),
                                       torch.as_tensor(value).to(F64), rtol=1e-10, atol=1e-15,
                                       msg=f"{name} {key}")
        if isinstance(opt_a, LARS):
            torch.testing.assert_close(opt_b.velocity(q), opt_a.velocity(p), rtol=1e-10,
                                       atol=1e-15)


@pytest.mark.parametrize("kernel", FAST_KERNELS)
@pytest.mark.parametrize("cls,kw", OPTION_CONFIGS, ids=config_id)
def test_every_option_matches_reference(cls, kw, kernel):
    ref = run(cls, kw, "reference")
    fast = run(cls, kw, kernel)
    start = dict(named_params())
    for name, p in ref[0][:3]:
        assert not torch.equal(p, start[name]), f"{name} did not move"
    assert_same(ref[0], ref[1], fast[0], fast[1])
    for a, b in zip(ref[2], fast[2], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15)


def bf16_against_reference(cls, kw, device, steps=3):
    """bfloat16 weights and gradients on ``device`` (Triton kernel): float32 state, and
    each step equals the float64 reference step from the same bfloat16 weights, rounded
    to bfloat16, within one rounding (float32 arithmetic can land on the other side of
    a rounding boundary)."""
    named = [(n, nn.Parameter(p.detach().to(device, torch.bfloat16))) for n, p in named_params()]
    opt = cls(named, exclude=("bias",), kernel="triton", **kw)
    ref_named = [(n, nn.Parameter(p.detach().double().cpu())) for n, p in named]
    ref_opt = cls(ref_named, exclude=("bias",), kernel="reference", **kw)
    for t in range(steps):
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = kw["lr"] * LRS[2 + t]
        grads = grads_like([p for _, p in named_params()], t)
        for (name, p), (_, q), g in zip(named, ref_named, grads, strict=True):
            g = (torch.zeros_like(g) if name.startswith("frozen") else g).bfloat16()
            p.grad, q.grad = g.to(device), g.double()
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            for (name, p), (_, q) in zip(named, ref_named, strict=True):
                torch.testing.assert_close(p.cpu(), q.bfloat16(), rtol=2**-7, atol=0, msg=name)
                q.copy_(p)  # the next step starts from the same weights
    for _, p in named:
        for value in opt.state[p].values():
            if value.ndim:
                assert value.dtype == torch.float32


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_tensor_lr_matches_float_lr(cls, kw):
    ref = run(cls, kw, "reference")
    named = named_params()
    opt = cls(named, exclude=("bias",), kernel="multi_tensor",
              **{**kw, "lr": torch.tensor(kw["lr"], dtype=F64)})
    fast = run(cls, kw, "multi_tensor", named=named, opt=opt)
    assert_same(ref[0], ref[1], fast[0], fast[1])


# ------------------------------------------------ state_dict in the multi-tensor kernel


def assert_round_trip_continues(cls, kw, kernel, before=3, total=6):
    """Saved after ``before`` steps and loaded into a fresh optimizer, the run goes on
    bit for bit as the uninterrupted one, to ``total`` steps."""
    whole = run(cls, kw, kernel, steps=total)
    named, opt, _ = run(cls, kw, kernel, steps=before)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for _, p in named], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    named2 = named_params()
    with torch.no_grad():
        for (_, p), value in zip(named2, saved["params"], strict=True):
            p.copy_(value)
    opt2 = cls(named2, exclude=("bias",), kernel=kernel, **kw)
    opt2.load_state_dict(saved["opt"])
    # continue from step `before` of the same lr schedule and gradients
    for t in range(before, total):
        for group in opt2.param_groups:
            group["lr"] = kw["lr"] * LRS[t]
        for (name, p), g in zip(named2, grads_like([p for _, p in named2], t), strict=True):
            p.grad = torch.zeros_like(p) if name.startswith("frozen") else g
        opt2.step()
    for (name, p), (_, q) in zip(whole[0], named2, strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_multi_tensor_state_dict_round_trip_continues_identically(cls, kw):
    assert_round_trip_continues(cls, kw, "multi_tensor")


@pytest.mark.parametrize("kernel", ["reference", "per_tensor", "multi_tensor"])
def test_lars_loads_old_state_with_float_local_lr(kernel):
    named, opt, _ = run(LARS, OPTION_CONFIGS[0][1], "reference", steps=4)
    state = opt.state_dict()
    for s in state["state"].values():
        s["local_lr"] = float(s["local_lr"])  # the format before local_lr became a tensor
    whole = run(LARS, OPTION_CONFIGS[0][1], "reference", steps=6)
    opt2 = LARS(named, exclude=("bias",), kernel=kernel, **OPTION_CONFIGS[0][1])
    opt2.load_state_dict(state)
    assert opt2.velocity(named[0][1]) is not None
    for t in range(4, 6):
        for group in opt2.param_groups:
            group["lr"] = OPTION_CONFIGS[0][1]["lr"] * LRS[t]
        for (name, p), g in zip(named, grads_like([p for _, p in named], t), strict=True):
            p.grad = torch.zeros_like(p) if name.startswith("frozen") else g
        opt2.step()
    for (name, p), (_, q) in zip(whole[0], named, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-15, msg=name)


# ------------------------------------------------ kernel choice


def test_kernel_argument_is_checked():
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="kernel"):
        LARS([p], kernel="fastest")
    with pytest.raises(ValueError, match="fast=False"):
        LAMB([p], fast=False, kernel="multi_tensor")
    assert LAMB([p], fast=False).kernel == "reference"


def test_auto_picks_per_tensor_on_cpu():
    p = nn.Parameter(torch.ones(2))
    opt = LARS([p])
    assert opt._choose_kernel([p]) == "per_tensor"
    assert LARS([p], fast=False)._choose_kernel([p]) == "reference"
    q = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    assert opt._choose_kernel([q]) == "reference"


# ------------------------------------- every CPU path at once, with the sizes made tiny


def mixed_params(seed=3):
    """Tensors of every size class and layout, in one list."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return [
        nn.Parameter(rand(5)),                                        # small
        nn.Parameter(rand(6, 4).t()),                                 # small, transposed
        nn.Parameter(rand(2, 3, 2, 2).to(memory_format=torch.channels_last)),  # small
        nn.Parameter(rand(30)),                                       # small, next block
        nn.Parameter(rand(12, 10)),                                   # whole
        nn.Parameter(rand(9, 50).t()),                                # chunked, transposed
        nn.Parameter(rand(4, 3, 5, 5).to(memory_format=torch.channels_last)),  # chunked
        nn.Parameter(rand(6, 40)[:, ::2]),                            # non-dense
        nn.Parameter(torch.zeros(7, 7, dtype=F64)),                   # zero norm
    ]


@pytest.mark.parametrize("cls,kw", LAYOUT_CONFIGS + [OPTION_CONFIGS[-1]],
                         ids=["LARS", "LARS-nesterov", "LAMB", "LAMB-clip"])
def test_mixed_sizes_take_every_cpu_path_and_match_reference(cls, kw, monkeypatch):
    """Blocks of small tensors, whole tensors, chunks with a ragged last one, a
    non-dense view: the per-tensor kernel equals the reference on all at once."""
    from bigbatch.optim import _blocks, _lamb_cpu

    monkeypatch.setattr(_blocks, "BLOCK", 40)
    monkeypatch.setattr(_blocks, "DOT_MIN", 16)
    monkeypatch.setattr(_lamb_cpu, "SMALL", 32)
    monkeypatch.setattr(_lamb_cpu, "WHOLE", 200)
    monkeypatch.setattr(_lamb_cpu, "CHUNK", 64)
    assert_mixed_match_reference(cls, kw, "per_tensor", steps=4)


def assert_mixed_match_reference(cls, kw, kernel, steps):
    """``mixed_params`` stepped together by ``kernel`` and by the reference: the same
    weights (strides kept) and trust ratios, in float64."""
    runs = []
    for k in ("reference", kernel):
        params = mixed_params()
        opt = cls(params, kernel=k, **kw)
        opt.track_trust_ratios = True
        for t in range(steps):
            for p, grad in zip(params, grads_like(params, t), strict=True):
                set_grad(p, grad, "like_param")
            opt.step()
        runs.append((params, opt.trust_ratios()))
    (ref, ref_ratios), (fast, fast_ratios) = runs
    for i, (a, b, start) in enumerate(zip(ref, fast, mixed_params(), strict=True)):
        assert b.stride() == start.stride(), i
        torch.testing.assert_close(b - start, a - start, rtol=1e-12, atol=1e-15, msg=str(i))
    torch.testing.assert_close(fast_ratios, ref_ratios, rtol=1e-10, atol=1e-15)
    assert not torch.equal(ref[5], mixed_params()[5])
