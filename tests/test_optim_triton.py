"""The Triton kernels of LARS and LAMB, run on CPU tensors by Triton's interpreter.

They equal the float64 reference on every option, memory layout and odd size
(float64 runs through the interpreter, so the tolerances are those of
``test_optim_kernels``), keep float32 state for bfloat16 parameters, take a
tensor learning rate, repeat bit for bit, launch as often for 40 tensors as
for 4, and give the single-process result on DTensor shards with one
all-reduce per step.

``TRITON_INTERPRET=1`` holds for this module only: ``_triton_plan.kernels``
loads one module instance per mode, so compiled CUDA tests in the same
process are unaffected. The interpreter runs each program as Python (about
0.1 s for a step of a few tiny tensors): sizes stay tiny, and the chunk and
block sizes are shrunk so that tensors still span several chunks and a
chunk several blocks. Skipped where Triton is not installed.
"""

import os
import re
from pathlib import Path

import pytest
import torch
from test_optim_kernels import (
    LAYOUT_CONFIGS,
    LAYOUTS,
    LRS,
    OPTION_CONFIGS,
    assert_mixed_match_reference,
    assert_round_trip_continues,
    assert_same,
    bf16_against_reference,
    config_id,
    grads_like,
    make_layout,
    named_params,
    run,
    set_grad,
)

from bigbatch.optim import LAMB, LARS, _triton_plan
from bigbatch.optim.lamb import lamb
from bigbatch.optim.lars import lars

pytest.importorskip("triton")

F64 = torch.float64
# Chunks of 16 elements in vectors of 8: named_params' 20-element weight spans two
# chunks, and every chunk of 9 or more elements loops twice.
SIZES = dict(CHUNK=16, BLOCK=8, REDUCE_BLOCK=4)


@pytest.fixture(autouse=True, scope="module")
def _interpreter(one_thread):
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in SIZES.items():
            mp.setattr(_triton_plan, name, value)
        yield
    if saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = saved


@pytest.mark.parametrize("cls,kw", OPTION_CONFIGS, ids=config_id)
def test_every_option_matches_reference(cls, kw):
    """Weights, excluded biases, a zero-initialised weight, zero gradients; lr from 0."""
    ref = run(cls, kw, "reference")
    fast = run(cls, kw, "triton")
    assert_same(ref[0], ref[1], fast[0], fast[1])
    for a, b in zip(ref[2], fast[2], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("grad_layout", ["like_param", "contiguous"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cls,kw", LAYOUT_CONFIGS[1:], ids=["LARS-nesterov", "LAMB"])
def test_every_layout_matches_reference(cls, kw, layout, grad_layout):
    """Transposed and channels_last weights are walked in memory order; a non-dense
    weight, or a gradient laid out unlike its weight, is staged and copied back."""
    runs = []
    for kernel in ("reference", "triton"):
        p = make_layout(layout)
        strides = p.stride()
        opt = cls([p], kernel=kernel, **kw)
        for t in range(3):
            set_grad(p, grads_like([p], t)[0], grad_layout)
            opt.step()
        assert p.stride() == strides
        runs.append((p.detach().clone(), opt.state[p]))
    (ref, ref_state), (fast, fast_state) = runs
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-15)
    for key, value in ref_state.items():
        torch.testing.assert_close(fast_state[key], value, rtol=1e-11, atol=1e-15)


@pytest.mark.parametrize("cls,kw", [LAYOUT_CONFIGS[1], OPTION_CONFIGS[7], OPTION_CONFIGS[-1]],
                         ids=["LARS-nesterov", "LAMB-clip", "LAMB-trust-clip"])
def test_odd_sizes_in_one_step_match_reference(cls, kw, monkeypatch):
    """Nine tensors at once: sizes 5 to 450 (one chunk, many chunks, a ragged last
    chunk), transposed, channels_last, a non-dense view, a zero weight."""
    monkeypatch.setattr(_triton_plan, "CHUNK", 64)
    monkeypatch.setattr(_triton_plan, "BLOCK", 16)
    assert_mixed_match_reference(cls, kw, "triton", steps=2)


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_bfloat16_parameters_keep_float32_state(cls, kw):
    bf16_against_reference(cls, kw, "cpu")


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_tensor_lr_gives_the_float_lr_bits(cls, kw):
    named = named_params()
    opt = cls(named, exclude=("bias",), kernel="triton",
              **{**kw, "lr": torch.tensor(kw["lr"], dtype=F64)})
    tensor_run = run(cls, kw, "triton", steps=4, named=named, opt=opt)
    float_run = run(cls, kw, "triton", steps=4)
    for (name, p), (_, q) in zip(float_run[0], tensor_run[0], strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_two_runs_are_bitwise_identical(cls, kw):
    first = run(cls, kw, "triton", steps=3)
    second = run(cls, kw, "triton", steps=3)
    for (name, p), (_, q) in zip(first[0], second[0], strict=True):
        assert torch.equal(p, q), name
        for key, value in first[1].state[p].items():
            assert torch.equal(second[1].state[q][key], value), (name, key)


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[0], OPTION_CONFIGS[6]], ids=config_id)
def test_launches_do_not_grow_with_the_tensor_count(cls, kw, monkeypatch):
    counts = []
    for n in (2, 20):
        named = [(f"w{i}", torch.nn.Parameter(torch.randn(3, 2, dtype=F64))) for i in range(n)]
        named += [(f"b{i}", torch.nn.Parameter(torch.randn(3, dtype=F64))) for i in range(n)]
        opt = cls(named, exclude=("b",), kernel="triton", **kw)
        for _, p in named:
            p.grad = torch.randn_like(p)
        calls = []
        launch = _triton_plan.launch

        def counted(*args, calls=calls, launch=launch, **kwargs):
            calls.append(args[0])
            launch(*args, **kwargs)

        monkeypatch.setattr(_triton_plan, "launch", counted)
        opt.step()
        monkeypatch.setattr(_triton_plan, "launch", launch)
        counts.append(len(calls))
    assert counts[0] == counts[1] == 4, counts  # two passes, two groups


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_state_dict_round_trip_continues_identically(cls, kw):
    assert_round_trip_continues(cls, kw, "triton", before=2, total=4)


def test_functional_form_equals_the_class():
    """``lamb()`` / ``lars()`` with one group's keywords take the class's step."""
    for cls, fn, kw, state in (
        (LAMB, lamb, dict(lr=0.05, weight_decay=0.01), lambda w: (torch.zeros(()), torch.zeros_like(w),
                                                                 torch.zeros_like(w))),
        (LARS, lars, dict(lr=0.5, trust_coefficient=0.05, weight_decay=1e-2),
         lambda w: (torch.zeros_like(w), torch.zeros((), dtype=w.dtype))),
    ):
        params = [p for _, p in named_params()][:1]
        opt = cls(params, kernel="triton", **kw)
        ws = [p.detach().clone() for p in params]
        states = [state(w) for w in ws]
        for t in range(2):
            grads = grads_like(params, t)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
            fn(ws, grads, states, kernel="triton", **kw)
        assert torch.equal(ws[0], params[0].detach()), cls.__name__


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    p = torch.nn.Parameter(torch.ones(3, dtype=F64))
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        LAMB([p], kernel="triton").step()
    assert LAMB([p])._choose_kernel([p]) == "per_tensor"  # auto never picks it on CPU


def _dtensor_cases(families, picks, dtypes, steps):
    """Runs in each gloo worker: ``test_optim_dist``'s cases at ``picks``, Triton kernel."""
    from test_optim_dist import _worker

    return {family: _worker(family, ("triton",), SIZES, dtypes, picks, steps)
            for family in families}


@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_dtensor_shards_take_the_plain_bits_and_one_all_reduce(cls, kw, tmp_path):
    """DTensor parameters (Shard(0) on a one-rank gloo mesh, in this process): the
    shards' norms go through ``reduce_chunks`` and one all-reduce per step (one more
    for LAMB's clipping), and the weights come out bit for bit as plain tensors'."""
    import torch.distributed as dist
    from _dist import CountCalls
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = named_params()
        sharded = [(n, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
                   for n, p in named_params()]
        opts = [cls(named, exclude=("bias",), kernel="triton", **kw) for named in (plain, sharded)]
        counts = []
        for t in range(3):
            grads = grads_like([p for _, p in plain], t)
            for (name, p), (_, q), g in zip(plain, sharded, grads, strict=True):
                g = torch.zeros_like(g) if name.startswith("frozen") else g
                p.grad, q.grad = g, distribute_tensor(g, mesh, [Shard(0)])
            opts[0].step()
            with CountCalls(("all_reduce",)) as c:
                opts[1].step()
            counts.append(c.calls)
        for (name, p), (_, q) in zip(plain, sharded, strict=True):
            assert torch.equal(q.full_tensor(), p), name
        assert counts == [1 + (kw.get("max_grad_norm") is not None)] * 3
    finally:
        dist.destroy_process_group()


def _dtensor_cases(families, picks, dtypes, steps):
    """Runs in each gloo worker: ``test_optim_dist``'s cases at ``picks``, Triton kernel."""
    from test_optim_dist import _worker

    return {family: _worker(family, ("triton",), SIZES, dtypes, picks, steps)
            for family in families}


@pytest.mark.slow
def test_dtensor_shards_on_two_ranks_equal_single_process():
    """FSDP2 and tensor-parallel DTensors on 2 gloo ranks, every case of
    ``test_optim_dist`` in float64 and float32: the Triton kernel on the local shards
    equals the single-process run, with one all-reduce of all squared norms per step
    (one more for LAMB's clipping). Slow: ~20 s a family through the interpreter."""
    from _dist import run_workers
    from test_optim_dist import check_equal_single_process, check_one_all_reduce_per_step

    families = ("LARS", "LAMB")
    per_rank = run_workers(_dtensor_cases, world_size=2, timeout=480, init_group=True,
                           args=(families, None, (F64, torch.float32), 10))
    for family in families:
        results = [r[family] for r in per_rank]
        check_equal_single_process(family, results)
        check_one_all_reduce_per_step(family, results)


# ------------------------------------------- compiled for a GPU, on a machine without one

_ARGS = {  # the kernels' non-constexpr arguments, as the steps pass them
    "*i64": ("ptrs", "chunk_tensor", "chunk_start", "numel", "first_chunk", "positions"),
    "*fp64": ("partials", "scalars", "total", "squares", "lr_ptr", "ratios", "out"),
    "*fp32": ("found",),
    "i32": ("n_tensors", "chunk0", "role"),
    "fp64": ("lr_value", "beta1", "beta2", "log_beta1", "log_beta2", "eps", "weight_decay",
             "max_norm", "momentum", "coeff"),
}


def _compile(kernel, **constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    types = {name: ty for ty, names in _ARGS.items() for name in names}
    signature = {a: "constexpr" if a in constexprs else types[a] for a in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return compile(source, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": _triton_plan.NUM_WARPS})


def test_kernels_compile_for_sm90_with_16_byte_accesses():
    """Triton compiles every kernel to a cubin here (ptxas ships with it): the compiled
    path, which the interpreter does not exercise, has no type or lowering error; with
    aligned tensors (ALIGN) the float32 loads and stores move 16 bytes each."""
    k = _triton_plan.kernels(torch.device("cuda"))
    tl = k.tl
    f32 = dict(W=tl.float32, S=tl.float32, C=tl.float32)
    sizes = dict(CHUNK=1 << 16, BLOCK=4096, ALIGN=4)  # the defaults (the fixture shrinks them)
    built = [
        _compile(k.lamb_moments, **f32, BIAS=True, NORMS=True, CLIP=True, SKIP=True, **sizes),
        _compile(k.lamb_update, **f32, BIAS=True, ADAPT=True, TRUST_CLIP=True, SUMMED=False,
                 LR_PTR=True, SKIP=False, RBLOCK=256, **sizes),
        _compile(k.lars_norms, **f32, NORMS=True, **sizes),
        _compile(k.lars_update, **f32, ADAPT=True, TRUST_CLIP=False, NESTEROV=True,
                 SUMMED=True, LR_PTR=False, SKIP=True, RBLOCK=256, **sizes),
        _compile(k.sum_squares, W=tl.float32, C=tl.float32, **sizes),
        _compile(k.reduce_chunks, K=2, RBLOCK=256),
        _compile(k.lamb_update, W=tl.bfloat16, S=tl.float32, C=tl.float32, BIAS=False,
                 ADAPT=False, TRUST_CLIP=False, SUMMED=False, LR_PTR=False, SKIP=True,
                 RBLOCK=256, **{**sizes, "ALIGN": 8}),
        _compile(k.lars_update, W=tl.float64, S=tl.float64, C=tl.float64, ADAPT=True,
                 TRUST_CLIP=True, NESTEROV=False, SUMMED=False, LR_PTR=True, SKIP=False,
                 RBLOCK=256, **{**sizes, "ALIGN": 1}),
    ]
    for compiled, stores in zip(built[:4], (True, True, False, True), strict=True):
        ptx = compiled.asm["ptx"]
        assert re.search(r"ld\.global\.v4\.b32", ptx), compiled.name
        assert bool(re.search(r"st\.global\.v4\.b32", ptx)) == stores, compiled.name


# ------------------------------------------------------------------ docs/gpu.md runs

_GPU_DOC = Path(__file__).resolve().parent.parent / "docs" / "gpu.md"


@pytest.mark.parametrize("snippet", re.findall(r"```python\n(.*?)```", _GPU_DOC.read_text(),
                                               re.S))
def test_gpu_page_snippets_run(snippet):
    exec(compile(snippet, str(_GPU_DOC), "exec"), {})


@pytest.mark.parametrize("at", [0, 1], ids=["first-step", "later-step"])
@pytest.mark.parametrize("kernel", ["triton", "reference"])
@pytest.mark.parametrize("cls,kw", [OPTION_CONFIGS[1], OPTION_CONFIGS[7]], ids=config_id)
def test_a_flagged_overflow_step_changes_nothing(cls, kw, kernel, at):
    """GradScaler's ``found_inf`` protocol (the engine's fp16 step on CUDA): a step with
    inf gradients and the flag set leaves weights and state bit for bit as they were
    (the Triton kernel reads the flag on the device), and a clear flag is a plain step."""
    plain = run(cls, kw, kernel, steps=3)
    named = named_params()
    opt = cls(named, exclude=("bias",), kernel=kernel, **kw)
    params = [p for _, p in named]
    base = [g["lr"] for g in opt.param_groups]
    for t in range(3):
        if t == at:
            for p in params:
                p.grad = torch.full_like(p, float("inf"))
            opt.found_inf = torch.ones((), dtype=torch.float32)
            opt.step()
        for group, lr0 in zip(opt.param_groups, base, strict=True):
            group["lr"] = lr0 * LRS[t % len(LRS)]
        for (name, p), g in zip(named, grads_like(params, t), strict=True):
            p.grad = torch.zeros_like(p) if name.startswith("frozen") else g
        opt.found_inf = torch.zeros((), dtype=torch.float32)
        opt.step()
    for (name, p), (_, q) in zip(plain[0], named, strict=True):
        assert torch.equal(p, q), name
        for key, value in plain[1].state[p].items():
            assert torch.equal(opt.state[q][key], value), (name, key)
