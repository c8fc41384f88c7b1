"""Compressed reductions and local SGD on 2 gloo workers, through the engine.

fp16/bf16 agree with the fp32 mean within their rounding; PowerSGD's error feedback loses
nothing (applied + remaining error = the true sum); DGC's dense phase is momentum SGD and
every held-back entry is sent eventually, with nothing lost; DGC resumes exactly; local
SGD averaging every step equals DDP. All scenarios share one spawn of two processes.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_workers
from test_engine import assert_same, make_data, make_model, make_tokens, params_of, strategy
from test_engine_dist import _feed

from bigbatch.engine import prepare
from bigbatch.parallel.compression import DGCState, reduce_hook, select_topk
from bigbatch.parallel.data_parallel import wrap_data_parallel

W, STEPS = 2, 3


def _run(s, x, y, micro, rank, steps=STEPS):
    run = prepare(make_model(), s, total_steps=steps)
    _feed(run, x, y, micro, rank)
    return run


def _tokens(s, rank):
    tx, ty, mask = make_tokens(steps=STEPS)
    run = prepare(make_model(), s, total_steps=STEPS)
    for step in range(STEPS):
        for j in range(0, 256, W * 64):
            rows = slice(j + rank * 64, j + (rank + 1) * 64)
            m = mask[step, rows]
            with run.micro_step() as ms:
                logits = run.model(tx[step, rows])
                ms.backward(F.cross_entropy(logits[m], ty[step, rows][m], reduction="sum"),
                            count=m.sum())
    return params_of(run.module)


def _raw_ddp(s, x_local, c_local, steps):
    """DDP with the strategy's reduce hook on a bias-free linear map whose gradient (rank 3)
    is the same every step (no optimizer): (true local gradient, applied gradients, state)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(x_local.shape[1], 3, bias=False).double()
    inner = reduce_hook(s, list(model.parameters()))
    ddp, comm = wrap_data_parallel(model, torch.device("cpu"), s.data_parallel, False, inner)
    applied = []
    for _ in range(steps):
        model.zero_grad()
        (ddp(x_local) * c_local).sum().backward()
        applied.append(model.weight.grad.clone())
    true = c_local.T @ x_local
    return true, applied, comm.inner_state


def _mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _worker() -> dict:
    rank = int(os.environ["RANK"])
    out: dict = {}
    x, y = make_data(steps=STEPS)
    for name, dp in (("mean", {}), ("fp16", {"reduce": "fp16"}), ("bf16", {"reduce": "bf16"}),
                     ("powersgd", {"reduce": "powersgd", "powersgd_rank": 1,
                                   "start_powersgd_iter": 2})):
        out[name] = params_of(_run(strategy("sgd", micro=128, data_parallel=dp), x, y, 128,
                                   rank).module)

    # DGC before rampup_begin_step: the hook's momentum and decay are momentum SGD's
    dense = {"rampup_begin_step": 100}
    out["mean_k2"] = params_of(_run(strategy("sgd", micro=64, k=2), x, y, 64, rank).module)
    run = _run(strategy("sgd", micro=64, k=2, dgc=dense), x, y, 64, rank)
    out["dgc_dense_k2"] = params_of(run.module)
    out["dgc_optimizer"] = run.optimizer.param_groups[0]["momentum"]
    out["tokens_mean"] = _tokens(strategy("sgd", micro=64, k=2), rank)
    out["tokens_dgc"] = _tokens(strategy("sgd", micro=64, k=2, dgc=dense), rank)
    # tensors under min_numel stay dense: after one step those equal momentum SGD's exactly
    run = _run(strategy("sgd", micro=128, dgc={"sparsity": [0.9], "min_numel": 100}), x[:1],
               y[:1], 128, rank, steps=1)
    out["dgc_mixed"] = params_of(run.module)
    out["mean_1"] = params_of(_run(strategy("sgd", micro=128), x[:1], y[:1], 128, rank,
                                   steps=1).module)
    out["dgc_mixed_share"] = run.stats["dgc_sent_share"]

    # PowerSGD error feedback and DGC's residual: nothing is lost
    g = torch.Generator().manual_seed(10 + rank)
    x_local = torch.randn(4, 20, generator=g, dtype=torch.float64) * torch.arange(1, 21)
    c_local = torch.randn(4, 3, generator=g, dtype=torch.float64)
    s = strategy("sgd", micro=128, data_parallel={"reduce": "powersgd", "powersgd_rank": 1,
                                                  "start_powersgd_iter": 2})
    true, applied, state = _raw_ddp(s, x_local, c_local, 6)
    (error,) = state.error_dict.values()
    out["powersgd_feedback"] = (_mean(true), applied, _mean(error.view(3, 20)))
    s = strategy("sgd", micro=128, optimizer={"momentum": 0.0, "weight_decay": 0.0},
                 dgc={"sparsity": [0.5, 0.9], "rampup_step": 4, "min_numel": 0})
    true, applied, state = _raw_ddp(s, x_local, c_local, 150)
    out["dgc_residual"] = (_mean(true), applied, _mean(state.v[0].view(3, 20)),
                           state.stats()["dgc_sent_share"])

    # DGC (sparse, momentum 0.9) resumes exactly from run.state_dict() mid-run
    s = strategy("sgd", micro=128, dgc={"sparsity": [0.9], "min_numel": 0})
    x4, y4 = make_data(steps=4)
    run = prepare(make_model(), s, total_steps=4)
    _feed(run, x4[:2], y4[:2], 128, rank)
    saved = copy.deepcopy((run.module.state_dict(), run.state_dict()))
    _feed(run, x4[2:], y4[2:], 128, rank)
    out["dgc_full"] = params_of(run.module)
    model = make_model()
    model.load_state_dict(saved[0])
    run = prepare(model, s, total_steps=4)
    run.load_state_dict(saved[1])
    _feed(run, x4[2:], y4[2:], 128, rank)
    out["dgc_resumed"] = params_of(run.module)
    out["dgc_moved"] = params_of(make_model())

    # local SGD: k = 1 is DDP; k = 2 averages after steps 3 and 5 (begin_step 1)
    x32, y32 = make_data(steps=5, dtype=torch.float32)
    for name, s in (("ddp32", strategy("sgd", micro=128)),
                    ("local_k1", strategy("sgd", micro=128, localsgd={"k_steps": 1}))):
        run = prepare(make_model(torch.float32), s, total_steps=5)
        _feed(run, x32, y32, 128, rank)
        out[name] = params_of(run.module)
    out["local_k2"] = _local_trace(strategy("sgd", micro=128, localsgd={"k_steps": 2}),
                                   x32, y32, rank)
    out["adaptive"] = _local_trace(
        strategy("sgd", micro=128, adaptive_localsgd={"init_k_steps": 2, "begin_step": 2}),
        x32, y32, rank)

    # local SGD resumes exactly: state_dict() averages, in the uninterrupted run too
    s = strategy("sgd", micro=64, k=2, localsgd={"k_steps": 3})
    run = prepare(make_model(torch.float32), s, total_steps=5)
    _feed(run, x32[:2], y32[:2], 64, rank)
    engine = run.state_dict()  # first: it averages the weights the model's state_dict saves
    saved = copy.deepcopy((run.module.state_dict(), engine))
    _feed(run, x32[2:], y32[2:], 64, rank)
    out["local_full"] = params_of(run.module)
    model = make_model(torch.float32)
    model.load_state_dict(saved[0])
    run = prepare(model, s, total_steps=5)
    run.load_state_dict(saved[1])
    _feed(run, x32[2:], y32[2:], 64, rank)
    out["local_resumed"] = params_of(run.module)
    return out


def _local_trace(s, x, y, rank):
    """Per step: (this worker's weights, the interval k, averages so far)."""
    run = prepare(make_model(torch.float32), s, total_steps=x.shape[0])
    trace = []
    run.step_hooks.append(lambda r: trace.append(
        (params_of(r.module), r.local_sgd.k, r.local_sgd.averages)))
    _feed(run, x, y, 128, rank)
    return trace


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, world_size=W, timeout=240)


def _differs(a, b):
    return any(not torch.equal(p, q) for p, q in zip(a, b, strict=True))


def _close(a, b, rtol, atol):
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_reduce_is_the_mean_within_rounding(results, name, tol):
    for r in range(W):
        _close(results[r][name], results[r]["mean"], rtol=tol, atol=tol / 10)
        # it really was sent at half precision: not bit-equal to the float64 mean
        assert _differs(results[r][name], results[r]["mean"])
    assert_same(results[0][name], results[1][name], rtol=0, atol=0)  # workers stay in step


def test_powersgd_is_the_mean_before_start_and_workers_agree(results):
    assert_same(results[0]["powersgd"], results[1]["powersgd"], rtol=0, atol=0)
    diff = max((p - q).abs().max().item()
               for p, q in zip(results[0]["powersgd"], results[0]["mean"], strict=True))
    assert 0 < diff < 0.05  # compressed from step 2 on: close, not equal


def test_powersgd_error_feedback_loses_nothing(results):
    for r in range(W):
        true, applied, error = results[r]["powersgd_feedback"]
        # step 1 is the plain mean; later steps are rank-1 approximations plus feedback
        torch.testing.assert_close(applied[0], true, rtol=1e-12, atol=1e-12)
        assert (applied[-1] - true).abs().max() > 1e-3
        # what was applied plus what the workers still hold is what they computed
        torch.testing.assert_close(sum(applied) + error, len(applied) * true,
                                   rtol=1e-9, atol=1e-9)


def test_dgc_dense_phase_is_momentum_sgd(results):
    for r in range(W):
        assert results[r]["dgc_optimizer"] == 0.0  # the hook owns the momentum
        _close(results[r]["dgc_dense_k2"], results[r]["mean_k2"], rtol=1e-10, atol=1e-12)
        _close(results[r]["tokens_dgc"], results[r]["tokens_mean"], rtol=1e-10, atol=1e-12)


def test_dgc_sends_small_tensors_whole(results):
    # Net: body.0.weight 128 and body.2.weight 256 entries are compressed (10% of each:
    # 13 and 26 sent); the biases (16, 16, 4) and head.weight (64) go whole
    mixed, mean = results[0]["dgc_mixed"], results[0]["mean_1"]
    for i in (1, 3, 4, 5):
        torch.testing.assert_close(mixed[i], mean[i], rtol=1e-12, atol=1e-14)
    for i in (0, 2):
        assert not torch.equal(mixed[i], mean[i])
    assert results[0]["dgc_mixed_share"] == pytest.approx((13 + 26 + 16 + 16 + 64 + 4) / 484)


def test_dgc_residual_is_sent_eventually_and_nothing_is_lost(results):
    for r in range(W):
        true, applied, residual, share = results[r]["dgc_residual"]
        steps = len(applied)
        sent = torch.stack([a != 0 for a in applied]).any(0)
        assert sent.all(), f"entries never sent in {steps} steps: {(~sent).sum().item()}"
        assert (applied[-1] != 0).float().mean() < 0.3  # sparse: each worker sends 10%
        assert share == pytest.approx((2 * 30 + (steps - 2) * 6) / (steps * 60))
        torch.testing.assert_close(sum(applied) + residual, steps * true, rtol=1e-9, atol=1e-9)


def test_dgc_resumes_exactly(results):
    for r in range(W):
        assert_same(results[r]["dgc_resumed"], results[r]["dgc_full"], rtol=0, atol=0)
        assert _differs(results[r]["dgc_full"], results[r]["dgc_moved"])


def test_select_topk_takes_the_largest_of_each_part():
    v = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, -0.5, 0.4, 0.3])
    idx = select_topk(v, [4, 4], sparsity=0.5)
    assert sorted(idx.tolist()) == [1, 3, 5, 6]
    assert sorted(select_topk(v, [4, 4], sparsity=0.9).tolist()) == [1, 5]  # at least one
    assert select_topk(v, [8], sparsity=0.0).tolist() == list(range(8))


def test_dgc_sparsity_warms_up_as_fleet():
    from bigbatch.config.sections import DGCConfig

    cfg = DGCConfig(rampup_begin_step=2, rampup_step=6, sparsity=(0.75, 0.9375, 0.999))
    state = DGCState([], 0.9, [], cfg)
    assert [state.sparsity_at(t) for t in range(10)] == [
        0.0, 0.0, 0.75, 0.75, 0.9375, 0.9375, 0.999, 0.999, 0.999, 0.999]


def test_local_sgd_k1_equals_ddp(results):
    for r in range(W):
        _close(results[r]["local_k1"], results[r]["ddp32"], rtol=1e-6, atol=1e-6)


def test_local_sgd_workers_agree_only_after_averages(results):
    a, b = results[0]["local_k2"], results[1]["local_k2"]
    same = [not _differs(a[t][0], b[t][0]) for t in range(5)]
    assert same == [True, False, True, False, True]  # step 1 synchronous, averages at 3, 5
    assert [a[t][2] for t in range(5)] == [0, 0, 1, 1, 2]


def test_adaptive_local_sgd_follows_fleets_rule(results):
    a, b = results[0]["adaptive"], results[1]["adaptive"]
    same = [not _differs(a[t][0], b[t][0]) for t in range(5)]
    # steps 1-2 synchronous, then init_k_steps = 2 local steps: an average at step 4
    assert same[:4] == [True, True, False, True] and a[3][2] == 1
    assert [t[1] for t in a] == [t[1] for t in b]  # both workers choose the same k
    assert same[4] == (a[3][1] == 1)


def test_adaptive_interval_rule():
    from bigbatch.parallel.local_sgd import adaptive_interval

    assert adaptive_interval(4, lr_0=0.1, loss_0=2.0, lr=0.1, loss=2.0) == 2  # ceil(sqrt(4))
    assert adaptive_interval(1, lr_0=0.1, loss_0=2.0, lr=0.01, loss=1.0) == 3  # ceil(sqrt(5))
    assert adaptive_interval(1, lr_0=0.1, loss_0=2.0, lr=1e-6, loss=2.0) == 16
    assert adaptive_interval(1, lr_0=0.1, loss_0=2.0, lr=0.1, loss=0.01) == 1


def test_local_sgd_resumes_exactly(results):
    for r in range(W):
        assert_same(results[r]["local_resumed"], results[r]["local_full"], rtol=0, atol=0)
    assert _differs(results[0]["local_full"], results[1]["local_full"])  # steps 4-5 were local


# ---------------------------------------------------------------- bad combinations, CLI

S = "--set"
TINY = ["--nproc", "1", "--no-progress", "--no-tensorboard", "--task-opt", "num_samples=1000",
        S, "batch.global_batch_size=64", S, "batch.base_batch_size=32", "--steps", "2"]
BAD = [
    ("lossy_with_noise_scale", [S, "data_parallel.reduce=powersgd", S, "adaptive.noise_scale=true"],
     'data_parallel.reduce="powersgd" with adaptive.noise_scale=true'),
    ("dgc_with_adascale", [S, "dgc.rampup_step=10", S, "adaptive.lr=adascale",
                           S, "batch.scaling=none"], 'data_parallel.reduce="dgc" with adaptive.lr'),
    ("dgc_section_with_adasum", [S, "dgc.enable=true", S, "data_parallel.reduce=adasum"],
     '[dgc] with data_parallel.reduce="adasum"'),
    ("dgc_with_lars", [S, "data_parallel.reduce=dgc"], 'data_parallel.reduce="dgc" with [lars]'),
    ("powersgd_with_fp16", [S, "data_parallel.reduce=powersgd", S, "amp.dtype=float16"],
     'amp.dtype="float16"'),
    ("powersgd_start_1", [S, "data_parallel.reduce=powersgd", S,
                          "data_parallel.start_powersgd_iter=1"], "start_powersgd_iter must be >= 2"),
    ("dgc_sparsity_range", [S, "dgc.sparsity=[0.5, 1.0]"], "dgc.sparsity must be in [0, 1)"),
    ("localsgd_with_fp16_reduce", [S, "localsgd.k_steps=4", S, "data_parallel.reduce=fp16"],
     '[localsgd] with data_parallel.reduce="fp16"'),
    ("both_local_sgd", [S, "localsgd.k_steps=4", S, "adaptive_localsgd.init_k_steps=2"],
     "[localsgd] and [adaptive_localsgd] are both enabled"),
    ("localsgd_with_sharding", [S, "localsgd.k_steps=2", S, "sharding.stage=2"],
     "[localsgd] with [sharding]"),
    ("ps_with_sharding", [S, "parameter_server.servers=1", S, "sharding.stage=1"],
     "[parameter_server] with [sharding]"),
    ("ps_with_tensor_parallel", [S, "parameter_server.mode=async",
                                 S, "tensor_parallel.tensor_parallel_degree=2"],
     "[parameter_server] with tensor parallelism"),
    ("ps_with_localsgd", [S, "parameter_server.servers=1", S, "localsgd.k_steps=2"],
     "[parameter_server] with [localsgd]"),
    ("ps_no_worker", [S, "parameter_server.servers=1"], "leaves no worker among 1 ranks"),
    ("ps_bad_mode", [S, "parameter_server.mode=hogwild"], "parameter_server.mode must be one of"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_combination_one_line_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    from bigbatch.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    code = main(["train", *TINY, "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the main job

MAIN_JOB = """
[batch]
global_batch_size = 64
base_batch_size = 32
base_lr = 0.05
warmup_steps = 2
decay = "cosine"

[optimizer]
type = "momentum"
weight_decay = 1e-4
"""


@pytest.mark.slow  # ~90 s on 2 shared cores: 2 workers, 3 runs each, two strategies
@pytest.mark.parametrize("extra", ['[dgc]\nsparsity = [0.9]\nmin_numel = 1000\n',
                                   "[localsgd]\nk_steps = 3\n"],
                         ids=["dgc", "localsgd"])
def test_main_job_resumes_exactly(extra, tmp_path, monkeypatch):
    import test_train as tt

    from bigbatch.tasks import get_task

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    get_task("mnist1d", **tt.SMALL)
    full, cut = tmp_path / "full", tmp_path / "cut"
    got = run_workers(tt._full_crash_resume, 2, (tt._config(full), tt._config(cut),
                                                 MAIN_JOB + extra, 3), timeout=300,
                      init_group=True)
    assert got == [[20, "crashed", 20]] * 2  # killed at step 12's checkpoint, resumed from 10
    tt._assert_same_weights(tt._final(full), tt._final(cut))
    last = tt._train_lines(full)[-1]  # and the mode was really on
    if "dgc" in extra:
        assert 0.1 < last["dgc_sent_share"] < 0.2  # 10% of the 3 big tensors, the rest whole
    else:
        assert last["local_sgd_k"] == 3 and last["local_sgd_averages"] == 6  # steps 4, 7, ..19
