"""The multi-tensor and Triton kernels on CUDA: equal to the float64 reference, no host
sync, capturable.

Runs only where CUDA is available (marked ``cuda``). Checks, for each kernel: every
option equals the CPU reference kernel in float64; ``torch.cuda.set_sync_debug_mode
("error")`` passes through whole steps; a step captured in a CUDA graph and replayed
gives the same parameters as eager steps. The Triton kernel (compiled, where Triton
imports) also: bfloat16 parameters with float32 state, and bitwise-repeatable steps.
"""

import importlib.util

import pytest
import torch
from test_optim_kernels import (
    LRS,
    OPTION_CONFIGS,
    STEPS,
    bf16_against_reference,
    config_id,
    grads_like,
    named_params,
)

from bigbatch.optim import LAMB, LARS

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

F64 = torch.float64
HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNELS = ["multi_tensor"] + (["triton"] if HAS_TRITON else [])
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


def on(device, named):
    return [(n, torch.nn.Parameter(p.detach().to(device))) for n, p in named]


def run(cls, kw, kernel, device, steps=STEPS, dtype=F64, track=True):
    named = on(device, named_params())
    with torch.no_grad():
        named = [(n, torch.nn.Parameter(p.to(dtype))) for n, p in named]
    opt = cls(named, exclude=("bias",), kernel=kernel, **kw)
    opt.track_trust_ratios = track
    ratios = []
    for t in range(steps):
        for group in opt.param_groups:
            group["lr"] = kw["lr"] * LRS[t % len(LRS)]
        grads = grads_like([p for _, p in named_params()], t)
        for (name, p), g in zip(named, grads, strict=True):
            p.grad = torch.zeros_like(p) if name.startswith("frozen") else g.to(device, dtype)
        opt.step()
        if track:
            ratios.append(opt.trust_ratios())
    return named, opt, ratios


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cls,kw", OPTION_CONFIGS, ids=config_id)
def test_cuda_kernel_matches_cpu_reference(cls, kw, kernel):
    ref_named, ref_opt, ref_ratios = run(cls, kw, "reference", "cpu")
    named, opt, ratios = run(cls, kw, kernel, "cuda")
    for (name, p), (_, q) in zip(ref_named, named, strict=True):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-11, atol=1e-14, msg=name)
        state = opt.state[q]
        if "step" in state:
            assert state["step"].device.type == "cuda"
        if "local_lr" in state:
            assert state["local_lr"].device.type == "cuda"
    for a, b in zip(ref_ratios, ratios, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[4], OPTION_CONFIGS[7],
                                    OPTION_CONFIGS[9]], ids=config_id)
def test_cuda_step_never_syncs_with_the_host(cls, kw, kernel):
    grads = [g.cuda() for g in grads_like([p for _, p in named_params()], 0)]
    if kernel == "triton":  # compile the kernels first: compiling is not the step
        warm = on("cuda", named_params())
        warm_opt = cls(warm, exclude=("bias",), kernel=kernel, **kw)
        for lr in (kw["lr"], 0.0):
            for group in warm_opt.param_groups:
                group["lr"] = lr
            for (_, p), g in zip(warm, grads, strict=True):
                p.grad = g.clone()
            warm_opt.step()
    named = on("cuda", named_params())
    opt = cls(named, exclude=("bias",), kernel=kernel, **kw)
    opt.track_trust_ratios = True
    torch.cuda.synchronize()
    try:
        for step in range(3):  # the first step creates the state: it must not sync either
            for group in opt.param_groups:
                group["lr"] = kw["lr"] * (0.0 if step == 1 else 1.0)
            torch.cuda.set_sync_debug_mode("error")
            for (_, p), g in zip(named, grads, strict=True):
                p.grad = g.clone()
            opt.step()
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.trust_ratios().shape == (len(named),)  # read here, outside the step


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[4], OPTION_CONFIGS[7],
                                    OPTION_CONFIGS[9]], ids=config_id)
def test_cuda_graph_replay_equals_eager_steps(cls, kw, tensor_lr, kernel):
    steps, warmup = 8, 3
    lrs = [kw["lr"] * f for f in (1.0, 0.5, 1.0, 0.25, 1.0, 0.0, 1.0, 0.5)] if tensor_lr \
        else [kw["lr"]] * steps
    all_grads = [[g.cuda() for g in grads_like([p for _, p in named_params()], t)]
                 for t in range(steps)]

    def build():
        named = on("cuda", named_params())
        lr = torch.tensor(lrs[0], dtype=F64, device="cuda") if tensor_lr else kw["lr"]
        opt = cls(named, exclude=("bias",), kernel=kernel, **{**kw, "lr": lr})
        for _, p in named:
            p.grad = torch.zeros_like(p)
        return named, opt

    def set_step(named, opt, t):
        for (_, p), g in zip(named, all_grads[t], strict=True):
            p.grad.copy_(g)
        if tensor_lr:
            for group in opt.param_groups:
                group["lr"].fill_(lrs[t])

    eager, eager_opt = build()
    for t in range(steps):
        set_step(eager, eager_opt, t)
        eager_opt.step()

    named, opt = build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in range(warmup):
            set_step(named, opt, t)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()  # recorded, not run
    for t in range(warmup, steps):
        set_step(named, opt, t)
        graph.replay()
    torch.cuda.synchronize()
    for (name, p), (_, q) in zip(eager, named, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-15, msg=name)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_cuda_float32_matches_reference_loosely(cls, kw, kernel):
    ref, _, _ = run(cls, kw, "reference", "cpu", dtype=torch.float32, track=False)
    fast, _, _ = run(cls, kw, kernel, "cuda", dtype=torch.float32, track=False)
    for (name, p), (_, q) in zip(ref, fast, strict=True):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-5, atol=1e-6, msg=name)


def test_cuda_default_kernel_is_triton_where_it_imports():
    p = torch.nn.Parameter(torch.ones(3, device="cuda"))
    assert LARS([p])._choose_kernel([p]) == ("triton" if HAS_TRITON else "multi_tensor")
    assert LAMB([p])._choose_kernel([p]) == ("triton" if HAS_TRITON else "multi_tensor")


@needs_triton
@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_cuda_triton_bfloat16_keeps_float32_state(cls, kw):
    bf16_against_reference(cls, kw, "cuda")


@needs_triton
@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_cuda_triton_steps_are_bitwise_repeatable(cls, kw):
    first, _, first_ratios = run(cls, kw, "triton", "cuda", dtype=torch.float32)
    second, _, second_ratios = run(cls, kw, "triton", "cuda", dtype=torch.float32)
    for (name, p), (_, q) in zip(first, second, strict=True):
        assert torch.equal(p, q), name
    for a, b in zip(first_ratios, second_ratios, strict=True):
        assert torch.equal(a, b)
