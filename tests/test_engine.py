"""Engine on one process: gradient merge equals the big batch, LR per step, AMP, recompute, errors."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.engine.step import takes_overflow_flag
from bigbatch.errors import ConfigError
from bigbatch.optim import param_groups
from bigbatch.parallel.world import World

D_IN, D_HID, N_CLS, T = 8, 16, 4, 6
ONE = World()


class Net(nn.Module):
    """Small MLP without BatchNorm, named blocks for recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_HID), nn.Tanh())
        self.head = nn.Linear(D_HID, N_CLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(dtype: torch.dtype = torch.float64) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def make_data(steps: int, n: int = 256, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, n, D_IN, generator=g).to(dtype)
    y = torch.randint(0, N_CLS, (steps, n), generator=g)
    return x, y


def make_tokens(steps: int, n: int = 256, seed: int = 2):
    """Variable-length sequences: (steps, n, T, D) inputs, targets, and a validity mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, n, T, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, N_CLS, (steps, n, T), generator=g)
    lengths = torch.randint(1, T + 1, (steps, n), generator=g)
    mask = torch.arange(T) < lengths[..., None]
    return x, y, mask


def strategy(opt: str = "sgd", global_batch: int = 256, micro: int | None = None,
             k: int | None = None, **sections) -> Strategy:
    d = {
        "batch": {"global_batch_size": global_batch, "base_batch_size": 64, "base_lr": 0.05,
                  "scaling": "sqrt", "warmup_steps": 1, "decay": "cosine"},
        "optimizer": {"type": "momentum", "momentum": 0.9, "weight_decay": 1e-4},
    }
    if micro is not None:
        d["batch"]["micro_batch_size"] = micro
    if k is not None:
        d["gradient_merge"] = {"k_steps": k}
    if opt in ("lars", "lamb", "adamw", "muon"):
        d["optimizer"]["weight_decay"] = 0.0 if opt != "adamw" else 1e-2
        if opt != "lars":
            d["optimizer"]["type"] = "adamw"
            d["batch"]["base_lr"] = 1e-3
        if opt in ("lars", "lamb", "muon"):
            d[opt] = {"exclude_from_weight_decay": ["bias"]}
    for name, body in sections.items():
        d.setdefault(name, {}).update(body)
    return Strategy.from_dict(d)


def train(model: nn.Module, s: Strategy, x: torch.Tensor, y: torch.Tensor, micro: int,
          total_steps: int = 3, **kw):
    """Feed each step's batch in micro-batches of `micro` rows; return the run."""
    run = prepare(model, s, total_steps=total_steps, world=ONE, **kw)
    for step in range(x.shape[0]):
        for i in range(0, x.shape[1], micro):
            with run.micro_step() as ms:
                loss = F.cross_entropy(run.model(x[step, i:i + micro]), y[step, i:i + micro])
                ms.backward(loss)
        assert ms.stepped
    return run


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-10, atol: float = 1e-12):
    assert len(a) == len(b)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


@pytest.mark.parametrize("nesterov", [None, False, True])
def test_lars_momentum_is_nesterov_unless_set_off(nesterov):
    """The engine's LARS steps equal bigbatch.optim.LARS's with the Nesterov setting in
    force: on when optimizer.nesterov is unset."""
    from bigbatch.optim import LARS

    s = strategy("lars", global_batch=64, lars={"lars_coeff": 0.02},
                 optimizer={} if nesterov is None else {"nesterov": nesterov})
    on = nesterov is not False
    x, y = make_data(steps=3, n=64)
    run = prepare(make_model(), s, total_steps=3, world=ONE)
    assert {g["nesterov"] for g in run.optimizer.param_groups} == {on}
    model = make_model()
    ref = LARS(model.named_parameters(), lr=0.0, momentum=0.9, trust_coefficient=0.02,
               weight_decay=s.lars.lars_weight_decay, exclude=("bias",), nesterov=on)
    lrs: list[float] = []
    run.optimizer.register_step_pre_hook(lambda o, a, kw: lrs.append(o.param_groups[0]["lr"]))
    for step in range(3):
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x[step]), y[step]))
        for g in ref.param_groups:
            g["lr"] = lrs[-1]
        ref.zero_grad()
        F.cross_entropy(model(x[step]), y[step]).backward()
        ref.step()
    assert_same(params_of(run.model), params_of(model))


# ---------------------------------------------------------------- gradient merge


@pytest.mark.parametrize("opt", ["sgd", "lars", "lamb", "adamw"])
def test_merge_k4_equals_big_batch(opt):
    x, y = make_data(steps=3)
    big = train(make_model(), strategy(opt), x, y, micro=256)
    merged = train(make_model(), strategy(opt, micro=64, k=4), x, y, micro=64)
    assert merged.k_steps == 4 and merged.step == big.step == 3
    assert_same(params_of(merged.module), params_of(big.module))
    # and the run moved: not a vacuous equality
    assert not torch.allclose(params_of(big.module)[0], params_of(make_model())[0])


def test_engine_k1_matches_hand_written_loop():
    x, y = make_data(steps=3)
    s = strategy("sgd")
    run = train(make_model(), s, x, y, micro=256)
    # By default biases and norm gains (ndim <= 1) are not decayed; [] decays everything.
    decay_all = train(make_model(), strategy(
        "sgd", optimizer={"exclude_from_weight_decay": []}), x, y, micro=256)
    for params, everything in ((run.module, False), (decay_all.module, True)):
        model = make_model()
        groups = model.parameters() if everything else param_groups(model, 1e-4)
        opt = torch.optim.SGD(groups, lr=0.0, momentum=0.9, weight_decay=1e-4)
        for step in range(3):
            for g in opt.param_groups:
                g["lr"] = run.schedule.lr(step)
            opt.zero_grad()
            F.cross_entropy(model(x[step]), y[step]).backward()
            opt.step()
        assert_same(params_of(params), params_of(model))
    assert not all(torch.equal(p, q) for p, q in zip(run.module.parameters(),
                                                      decay_all.module.parameters(), strict=True))


def token_train(model, s, x, y, mask, micro, mean=False, int_count=False):
    run = prepare(model, s, total_steps=3, world=ONE)
    for step in range(x.shape[0]):
        for i in range(0, x.shape[1], micro):
            m = mask[step, i:i + micro]
            with run.micro_step() as ms:
                logits = run.model(x[step, i:i + micro])
                loss = F.cross_entropy(logits[m], y[step, i:i + micro][m], reduction="sum")
                if mean:
                    ms.backward(loss / m.sum())
                else:
                    ms.backward(loss, count=int(m.sum()) if int_count else m.sum())
    return run


@pytest.mark.parametrize("int_count", [False, True])
def test_token_loss_with_count_equals_big_batch(int_count):
    x, y, mask = make_tokens(steps=3)
    counts = mask[0].reshape(4, 64, T).sum(dim=(1, 2))
    assert len(set(counts.tolist())) > 1  # micro-batches really differ in item count
    big = token_train(make_model(), strategy("sgd"), x, y, mask, micro=256, mean=True)
    merged = token_train(make_model(), strategy("sgd", micro=64, k=4), x, y, mask, micro=64,
                         int_count=int_count)
    assert_same(params_of(merged.module), params_of(big.module))
    # a naive mean of per-micro-batch means is measurably different
    naive = token_train(make_model(), strategy("sgd", micro=64, k=4), x, y, mask, micro=64, mean=True)
    assert not torch.allclose(params_of(naive.module)[0], params_of(big.module)[0], rtol=1e-9, atol=0)


def captured_grads(run):
    seen = []
    run.grad_hooks.append(lambda info: seen.append([g.clone() for g in info.grads()]))
    return seen


def test_avg_false_sums_the_k_gradients():
    x, y = make_data(steps=1)
    runs = {}
    for avg in (True, False):
        s = strategy("sgd", micro=64, k=4, gradient_merge={"avg": avg})
        run = prepare(make_model(), s, total_steps=3, world=ONE)
        seen = captured_grads(run)
        for i in range(0, 256, 64):
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[0, i:i + 64]), y[0, i:i + 64]))
        runs[avg] = seen[0]
    assert_same([4 * g for g in runs[True]], runs[False])


def test_local_norm_first_micro_step_on_one_worker():
    x, y = make_data(steps=1)
    run = prepare(make_model(), strategy("sgd", micro=64, k=4), total_steps=3, world=ONE,
                  local_grad_norm=True)
    infos = []
    run.grad_hooks.append(lambda info: infos.append((info.local_sq_norm, info.local_batch,
                                                      info.global_sq_norm(), info.global_batch)))
    ref = make_model()
    F.cross_entropy(ref(x[0, :64]), y[0, :64]).backward()
    first = sum(p.grad.square().sum() for p in ref.parameters())
    for i in range(0, 256, 64):
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x[0, i:i + 64]), y[0, i:i + 64]))
    local_sq, local_b, global_sq, global_b = infos[0]
    torch.testing.assert_close(local_sq, first)
    assert (local_b, global_b) == (64, 256)
    assert float(global_sq) < float(local_sq)  # averaging 4x the items shrinks the noise


def test_local_norm_first_micro_step_with_count():
    x, y, mask = make_tokens(steps=1)
    run = prepare(make_model(), strategy("sgd", micro=64, k=4), total_steps=3, world=ONE,
                  local_grad_norm=True)
    infos = []
    run.grad_hooks.append(lambda info: infos.append((info.local_sq_norm, info.local_batch,
                                                      info.global_batch)))
    ref = make_model()
    m = mask[0, :64]
    (F.cross_entropy(ref(x[0, :64])[m], y[0, :64][m], reduction="sum") / m.sum()).backward()
    first = sum(p.grad.square().sum() for p in ref.parameters())
    for i in range(0, 256, 64):
        m = mask[0, i:i + 64]
        with run.micro_step() as ms:
            loss = F.cross_entropy(run.model(x[0, i:i + 64])[m], y[0, i:i + 64][m], reduction="sum")
            ms.backward(loss, count=m.sum())
    local_sq, local_b, global_b = infos[0]
    torch.testing.assert_close(local_sq, first)
    assert (local_b, global_b) == (float(mask[0, :64].sum()), float(mask[0].sum()))


# ---------------------------------------------------------------- learning rate


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
@pytest.mark.parametrize("decay", ["cosine", "poly", "step", "none"])
def test_lr_seen_by_optimizer_each_step(rule, decay):
    steps, k = 7, 2
    batch = {"scaling": rule, "decay": decay, "warmup_steps": 2, "decay_milestones": [0.5, 0.8],
             "decay_power": 2.0, "global_batch_size": 32, "micro_batch_size": 16}
    s = strategy("sgd", k=k, batch=batch)
    run = prepare(make_model(), s, total_steps=steps, world=ONE)
    seen = []
    run.optimizer.register_step_pre_hook(lambda opt, a, kw: seen.append(opt.param_groups[0]["lr"]))
    x, y = make_data(steps=steps, n=32)
    for step in range(steps):
        for i in range(0, 32, 16):
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[step, i:i + 16]), y[step, i:i + 16]))
    assert len(seen) == steps == run.step  # once per optimizer step, not per micro-step
    scale = 32 / 64
    peak = 0.05 * (scale if rule == "linear" else math.sqrt(scale))
    assert run.plan.peak_lr == pytest.approx(peak)
    expected = [run.schedule.lr(t) for t in range(steps)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[2] == pytest.approx(peak)  # end of warmup
    start = 0.05 if peak > 0.05 else 0.0
    assert seen[0] == pytest.approx(start) and seen[1] == pytest.approx((start + peak) / 2)
    if decay == "cosine":
        p = (4 - 2) / (steps - 2)
        assert seen[4] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * p)))


# ---------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_amp_runs_on_cpu(dtype):
    x, y = make_data(steps=3, dtype=torch.float32)
    s = strategy("sgd", micro=128, k=2, amp={"dtype": dtype, "init_loss_scaling": 1024.0})
    run = train(make_model(torch.float32), s, x, y, micro=128)
    assert (run.scaler is None) == (dtype == "bfloat16")
    assert run.step == 3 and run.skipped_steps == 0
    st = run.stats
    assert st["loss_scale"] == (1.0 if dtype == "bfloat16" else 1024.0)
    assert all(torch.isfinite(p).all() for p in run.module.parameters())


def fp16_run(amp: dict, inject: set[int], n_steps: int = 4, micro: int = 32,
             device_skip: bool = False, opt: str = "sgd"):
    """fp16 run with k=2; loss made inf on the optimizer steps (calls) listed in `inject`.
    `device_skip`: the overflow flag stays on the device, as on CUDA (`Run.device_skip`)."""
    x, y = make_data(steps=n_steps, n=2 * micro, dtype=torch.float32)
    s = strategy(opt, global_batch=2 * micro, micro=micro, k=2, amp={"dtype": "float16", **amp})
    run = prepare(make_model(torch.float32), s, total_steps=10, world=ONE)
    assert not run.device_skip  # a CPU run reads the flag
    if device_skip:
        assert takes_overflow_flag(run.optimizer), type(run.optimizer)
        run.device_skip = True
    lrs, snapshots, results = [], [], []
    run.optimizer.register_step_pre_hook(lambda opt, a, kw: lrs.append(opt.param_groups[0]["lr"]))
    for call in range(n_steps):
        snapshots.append(params_of(run.module))
        for i in range(0, 2 * micro, micro):
            with run.micro_step() as ms:
                loss = F.cross_entropy(run.model(x[call, i:i + micro]), y[call, i:i + micro])
                if call in inject and i == 0:
                    loss = loss * float("inf")
                ms.backward(loss)
        results.append((ms.stepped, ms.skipped, run.stats["loss_scale"]))
    snapshots.append(params_of(run.module))
    return run, lrs, snapshots, results


def test_fp16_overflow_skips_step_and_holds_schedule():
    run, lrs, snaps, results = fp16_run({"init_loss_scaling": 1024.0}, inject={1})
    assert [r[:2] for r in results] == [(True, False), (False, True), (True, False), (True, False)]
    assert run.skipped_steps == 1 and run.step == 3 and run.stats["skipped_steps"] == 1
    assert_same(snaps[1], snaps[2], rtol=0, atol=0)  # skipped: weights untouched
    assert lrs == pytest.approx([run.schedule.lr(t) for t in range(3)])  # not advanced
    # Fleet default decr_every_n_nan_or_inf=2: one overflow does not back off yet
    assert [r[2] for r in results] == [1024.0] * 4


def test_fp16_fleet_loss_scaling_counters():
    amp = {"init_loss_scaling": 1024.0, "decr_every_n_nan_or_inf": 2, "incr_every_n_steps": 2,
           "decr_ratio": 0.5, "incr_ratio": 2.0}
    _, _, _, results = fp16_run(amp, inject={0, 1}, n_steps=5)
    # two overflows in a row halve; two good steps in a row double
    assert [r[2] for r in results] == [1024.0, 512.0, 512.0, 1024.0, 1024.0]
    _, _, _, results = fp16_run({**amp, "use_dynamic_loss_scaling": False}, inject={0, 1}, n_steps=5)
    assert [r[2] for r in results] == [1024.0] * 5
    assert [r[1] for r in results] == [True, True, False, False, False]


@pytest.mark.parametrize("opt", ["sgd", "adamw", "lamb", "lars", "muon"])
def test_fp16_overflow_skipped_on_the_device(opt):
    """The CUDA mode: the optimizer skips the overflow step itself (fused SGD/AdamW read
    GradScaler's flag; LAMB/LARS/Muon too), the schedule advances, the step is still counted
    as skipped, and the loss scale follows the same Fleet counters."""
    run, lrs, snaps, results = fp16_run({"init_loss_scaling": 1024.0}, inject={1},
                                        device_skip=True, opt=opt)
    assert [r[:2] for r in results] == [(True, False)] * 4
    assert run.step == 4 and run.skipped_steps == 1 and run.stats["skipped_steps"] == 1
    assert_same(snaps[1], snaps[2], rtol=0, atol=0)  # the update was skipped
    assert not any(torch.equal(a, b) for a, b in zip(snaps[2], snaps[3], strict=True))
    assert lrs == pytest.approx([run.schedule.lr(t) for t in range(4)])  # advanced
    if opt == "adamw":  # Adam's step count held too (its bias correction)
        assert {float(st["step"]) for st in run.optimizer.state.values()} == {3.0}
    amp = {"init_loss_scaling": 1024.0, "decr_every_n_nan_or_inf": 2, "incr_every_n_steps": 2}
    host = fp16_run(amp, inject={0, 1}, n_steps=5, opt=opt)[3]
    device = fp16_run(amp, inject={0, 1}, n_steps=5, device_skip=True, opt=opt)[3]
    assert [r[2] for r in device] == [r[2] for r in host] == [1024.0, 512.0, 512.0, 1024.0, 1024.0]


def test_fp16_device_skip_reads_nothing_to_the_host(monkeypatch):
    """No value leaves the device during the steps: every way a tensor reaches Python
    fails inside them (the check `torch.cuda.set_sync_debug_mode` makes on a GPU)."""
    run, *_ = fp16_run({"init_loss_scaling": 1024.0}, inject=set(), n_steps=1, device_skip=True)
    x, y = make_data(steps=3, n=64, dtype=torch.float32)

    def refuse(*a, **k):
        raise AssertionError("a tensor was read to the host during the step")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, refuse)
        for step in range(3):
            for i in (0, 32):
                with run.micro_step() as ms:
                    loss = F.cross_entropy(run.model(x[step, i:i + 32]), y[step, i:i + 32])
                    ms.backward(loss * float("inf") if step == 1 and i == 0 else loss)
    assert run.step == 4 and run.skipped_steps == 1


# ---------------------------------------------------------------- recompute


def test_recompute_gives_identical_gradients():
    x, y = make_data(steps=1)
    grads, inner_calls = {}, {}
    for on in (False, True):
        model = make_model()
        calls = inner_calls[on] = []
        model.body[0].register_forward_hook(lambda *a, c=calls: c.append(1))
        s = strategy("sgd", recompute={"checkpoints": ["body"]} if on else {"enable": False})
        run = prepare(model, s, total_steps=3, world=ONE)
        seen = captured_grads(run)
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x[0]), y[0]))
        grads[on] = seen[0]
    assert_same(grads[True], grads[False], rtol=0, atol=0)
    # the block's children ran again in backward: really recomputed
    assert (len(inner_calls[False]), len(inner_calls[True])) == (1, 2)
    assert list(run.module.state_dict()) == list(make_model().state_dict())  # names unchanged
    clone = copy.deepcopy(run.module)
    assert clone.body.forward.module is clone.body  # the wrapper follows a deep copy
    torch.testing.assert_close(clone(x[0]), run.module(x[0]))


# ---------------------------------------------------------------- state and stats


def test_state_dict_resume_mid_window_is_exact():
    x, y = make_data(steps=4)
    s = strategy("lamb", micro=64, k=4, amp={"dtype": "bfloat16"})
    full = train(make_model(), s, x, y, micro=64, total_steps=4)

    run = prepare(make_model(), s, total_steps=4, world=ONE)
    chunks = [(step, i) for step in range(4) for i in range(0, 256, 64)]
    for step, i in chunks[:6]:  # one full step plus half a window
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x[step, i:i + 64]), y[step, i:i + 64]))
    state, weights = copy.deepcopy(run.state_dict()), copy.deepcopy(run.module.state_dict())
    assert state["step"] == 1 and state["micro"] == 2

    model = make_model()
    model.load_state_dict(weights)
    resumed = prepare(model, s, total_steps=4, world=ONE)
    resumed.load_state_dict(state)
    for step, i in chunks[6:]:
        with resumed.micro_step() as ms:
            ms.backward(F.cross_entropy(resumed.model(x[step, i:i + 64]), y[step, i:i + 64]))
    assert resumed.step == 4
    assert_same(params_of(resumed.module), params_of(full.module), rtol=0, atol=0)


def test_fp16_scaler_state_round_trips():
    run, *_ = fp16_run({"init_loss_scaling": 1024.0, "incr_every_n_steps": 3}, inject={0, 1}, n_steps=3)
    state = run.state_dict()
    other = prepare(make_model(torch.float32), run.strategy, total_steps=10, world=ONE)
    other.load_state_dict(state)
    assert other.scaler.state_dict() == run.scaler.state_dict() == {"scale": 512.0, "good_steps": 1, "bad_steps": 0}
    assert other.skipped_steps == 2 and other.step == 1


def test_stats_with_tracking():
    x, y = make_data(steps=2)
    run = prepare(make_model(), strategy("lars"), total_steps=2, world=ONE, track_stats=True)
    norms = []
    run.grad_hooks.append(lambda info: norms.append(float(info.global_sq_norm().sqrt())))
    for step in range(2):
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x[step]), y[step]))
    st = run.stats
    assert {"lr", "loss_scale", "skipped_steps", "step", "grad_norm"} <= set(st)
    assert st["lr"] == pytest.approx(run.schedule.lr(1)) and st["step"] == 2
    assert st["grad_norm"] == pytest.approx(norms[-1], rel=1e-12)
    assert 0 < st["trust_ratio_min"] <= st["trust_ratio_median"] <= st["trust_ratio_max"]
    assert "grad_norm" not in prepare(make_model(), strategy(), total_steps=2, world=ONE).stats


# ---------------------------------------------------------------- errors


def one_line_error(fn, *match):
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for m in match:
        assert m in msg, msg
    return msg


def test_bad_configs_are_one_line_errors(monkeypatch):
    one_line_error(lambda: prepare(make_model(), strategy(recompute={"checkpoints": ["bdy"]}),
                                   total_steps=3, world=ONE), "recompute.checkpoints", "'bdy'", "'body'")
    monkeypatch.setitem(sys.modules, "bigbatch.adaptive.adasum", None)  # as if the module were absent
    one_line_error(lambda: prepare(make_model(), strategy(data_parallel={"reduce": "adasum"}),
                                   total_steps=3, world=ONE), "adasum")
    one_line_error(lambda: prepare(make_model(), strategy(batch={"warmup_steps": 0, "warmup_epochs": 1.0}),
                                   total_steps=3, world=ONE), "steps_per_epoch")
    one_line_error(lambda: prepare(make_model(), strategy(data_parallel={"sync_batch_norm": True}),
                                   total_steps=3, world=World(rank=0, world_size=2)), "sync_batch_norm")
    run = prepare(make_model(), strategy(micro=64, k=4), total_steps=3, world=ONE)
    x, y = make_data(steps=1)

    def mixed():
        for i, count in ((0, None), (64, 64)):
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[0, i:i + 64]), y[0, i:i + 64]), count=count)

    one_line_error(mixed, "count=")


def test_world_from_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    w = World.from_env(device="cpu")
    assert (w.rank, w.world_size, w.local_rank, w.is_distributed) == (0, 1, 0, False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    w = World.from_env(device="cpu")
    assert (w.rank, w.world_size, w.local_rank, w.is_main) == (3, 4, 1, False)
    monkeypatch.setenv("WORLD_SIZE", "two")
    one_line_error(lambda: World.from_env(device="cpu"), "WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_line_error(lambda: World.from_env(device="cpu"), "rank=3")
    from bigbatch.parallel.world import resolve_backend

    one_line_error(lambda: resolve_backend("nccl", torch.device("cpu")), "nccl")
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"


def test_micro_step_without_backward_is_an_error():
    run = prepare(make_model(), strategy(), total_steps=3, world=ONE)
    with pytest.raises(RuntimeError, match="ms.backward"), run.micro_step():
        pass
