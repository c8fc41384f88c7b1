"""`[adaptive]` on the engine, one process: noise scale, AdaScale, goodput, resume, errors."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from test_engine import ONE, make_data, make_model, params_of, strategy
from torch import nn

from bigbatch.adaptive.adascale import gain as adascale_gain
from bigbatch.adaptive.gns import GradientNoiseScale
from bigbatch.adaptive.goodput import ThroughputParams, step_time
from bigbatch.engine.prepare import prepare
from bigbatch.engine.run import schedule_steps
from bigbatch.errors import ConfigError

BETA2, EPS = 0.999, 1e-8  # the test strategy's AdamW


def feed(run, x, y, micro, steps=None, loss=F.cross_entropy):
    """Each optimizer step gets the next `micro * k_steps` rows, read from the run's plan."""
    for t in range(x.shape[0] if steps is None else steps):
        k = run.k_steps
        for i in range(0, micro * k, micro):
            with run.micro_step() as ms:
                ms.backward(loss(run.model(x[t, i:i + micro]), y[t, i:i + micro]))
        assert ms.stepped


def snapshot_hook(run, out):
    """Grad hook recording the pre-step parameters (and Adam's second moments)."""
    def hook(info):
        st = run.optimizer.state
        moments = [(st[p]["exp_avg_sq"].clone(), float(st[p]["step"]))
                   if "exp_avg_sq" in st.get(p, {}) else None for p in info.params]
        out.append((params_of(run.module), moments))
    run.grad_hooks.append(hook)


def grads_at(params, x, y):
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def precondition(grads, moments):
    if moments[0] is None:
        return grads
    return [g / ((v / (1 - BETA2**t)).sqrt() + EPS) for g, (v, t) in zip(grads, moments, strict=True)]


def sq(grads) -> float:
    return float(sum(g.double().square().sum() for g in grads))


def assert_stats_match(run, expected: GradientNoiseScale):
    stats = run.stats
    assert expected.steps > 0
    for key, value in (("gns", expected.b_simple), ("gns_sq_norm", expected.sq_norm),
                       ("gns_trace", expected.trace)):
        if math.isfinite(value):
            assert stats[key] == pytest.approx(value, rel=1e-8), key
        else:  # e.g. no signal yet (|G|^2 estimate <= 0): left out, not inf
            assert key not in stats
    if math.isfinite(expected.b_simple_stderr):
        assert stats["gns_stderr"] == pytest.approx(expected.b_simple_stderr, rel=1e-6)
    assert stats["gns_biased"] == float(expected.biased)


# ---------------------------------------------------------------- noise scale


@pytest.mark.parametrize("opt,k", [("sgd", 4), ("adamw", 2)])
def test_noise_scale_under_merge_equals_direct_computation(opt, k):
    x, y = make_data(steps=5)
    micro = 256 // k
    run = prepare(make_model(), strategy(opt, micro=micro, k=k, adaptive={"noise_scale": True,
                                                                     "gns_warmup_steps": 0}),
                  total_steps=5, world=ONE)
    snaps = []
    snapshot_hook(run, snaps)
    feed(run, x, y, micro)
    expected = GradientNoiseScale(0.95)
    for t, (params, moments) in enumerate(snaps):
        if opt == "adamw" and moments[0] is None:
            continue  # no second moments yet: the engine skips the first step
        small = sq(precondition(grads_at(params, x[t, :micro], y[t, :micro]), moments))
        big = sq(precondition(grads_at(params, x[t], y[t]), moments))
        expected.update(small, big, micro, 256)
    assert_stats_match(run, expected)
    assert not expected.biased


def test_noise_scale_from_consecutive_steps_is_marked_biased():
    x, y = make_data(steps=5)
    run = prepare(make_model(), strategy("sgd", adaptive={"noise_scale": True}), total_steps=5,
                  world=ONE)
    snaps = []
    snapshot_hook(run, snaps)
    feed(run, x, y, 256)
    expected = GradientNoiseScale(0.95, biased=True)
    prev = None
    for t, (params, _) in enumerate(snaps):
        g = grads_at(params, x[t], y[t])
        if prev is not None:
            mean = [(a + b) / 2 for a, b in zip(g, prev, strict=True)]
            expected.update((sq(g) + sq(prev)) / 2, sq(mean), 256, 512)
        prev = g
    assert expected.steps == 4
    assert_stats_match(run, expected)


def test_no_adaptive_keys_without_the_section():
    x, y = make_data(steps=2)
    run = prepare(make_model(), strategy("sgd"), total_steps=2, world=ONE)
    feed(run, x, y, 256)
    assert run.adaptive is None and not any(k.startswith("gns") for k in run.stats)
    assert run.done and run.progress == run.step == 2


# ---------------------------------------------------------------- AdaScale


@pytest.mark.parametrize("opt,power", [("sgd", 1.0), ("lamb", 0.5)])
def test_adascale_progress_and_lr_under_merge(opt, power):
    steps, total = 6, 30
    x, y = make_data(steps=steps)
    s = strategy(opt, micro=128, k=2, batch={"scaling": "none", "warmup_steps": 4},
                 adaptive={"lr": "adascale", "gns_warmup_steps": 0})
    run = prepare(make_model(), s, total_steps=total, world=ONE)
    ada = run.adaptive.adascale
    assert ada.scale == 4 and ada.power == power
    lrs, seen = [], []
    run.optimizer.register_step_pre_hook(lambda o, a, kw: lrs.append(o.param_groups[0]["lr"]))
    run.grad_hooks.append(lambda info: seen.append(
        (run.progress, ada.last_gain, run.adaptive.tracker.sq_norm, run.adaptive.tracker.trace)))
    feed(run, x, y, 128)
    gains = [g for _, g, _, _ in seen]
    for lr, (before, g, sqn, tr) in zip(lrs, seen, strict=True):
        assert g == pytest.approx(adascale_gain(tr / 64, sqn, 4.0), rel=1e-12)
        assert lr == pytest.approx(run.schedule.lr(before) * g**power, rel=1e-12)
    assert [b for b, *_ in seen] == pytest.approx([sum(gains[:i]) for i in range(steps)])
    assert run.progress == pytest.approx(sum(gains)) and ada.progress == pytest.approx(sum(gains))
    assert max(gains) > 1.2 and all(1.0 <= g <= 4.0 for g in gains)  # noise makes the batch pay
    stats = run.stats
    assert stats["adascale_gain"] == gains[-1] and stats["progress"] == run.progress
    assert run.done == (run.progress >= total) == ada.done(total)


def test_schedule_steps_count_scale1_steps_under_adascale():
    fixed = strategy("sgd", global_batch=256)
    assert schedule_steps(fixed, 1, 10_000, 2.0) == (78, 39)
    ada = strategy("sgd", global_batch=256, batch={"scaling": "none"}, adaptive={"lr": "adascale"})
    assert schedule_steps(ada, 1, 10_000, 2.0) == (312, 156)  # base batch 64


# ---------------------------------------------------------------- resume


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("opt,k", [("sgd", 2), ("adamw", None)])
def test_resume_is_bit_identical_with_adaptive_state(opt, k):
    x, y = make_data(steps=6)
    micro = 256 // (k or 1)
    s = strategy(opt, micro=micro, k=k, batch={"scaling": "none"},
                 adaptive={"lr": "adascale", "noise_scale": True, "gns_warmup_steps": 0})
    full = prepare(make_model(), s, total_steps=40, world=ONE)
    feed(full, x, y, micro)
    first = prepare(make_model(), s, total_steps=40, world=ONE)
    feed(first, x[:3], y[:3], micro)
    state, weights = _roundtrip(first.state_dict()), _roundtrip(first.module.state_dict())
    model = make_model()
    model.load_state_dict(weights)
    resumed = prepare(model, s, total_steps=40, world=ONE)
    resumed.load_state_dict(state)
    feed(resumed, x[3:], y[3:], micro)
    for a, b in zip(params_of(resumed.module), params_of(full.module), strict=True):
        assert torch.equal(a, b)
    assert resumed.stats == full.stats
    assert resumed.adaptive.state_dict()["tracker"] == full.adaptive.state_dict()["tracker"]
    assert full.stats["gns_biased"] == (k is None)


# ---------------------------------------------------------------- goodput


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 1).double()

    def forward(self, x):
        return self.fc(x).squeeze(-1)


def regression_data(steps, n):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(steps, n, 8, generator=g, dtype=torch.float64)
    return x, x @ torch.linspace(-1, 1, 8, dtype=torch.float64)  # noise scale ~ dimension


def test_goodput_shrinks_batch_and_logs_reason(caplog):
    # Synthetic step times: one worker, so merging never buys throughput; a small noise
    # scale (noiseless regression) makes the smaller batch worth more per example.
    model_t = ThroughputParams(alpha_c=0.01, beta_c=0.001)
    s = strategy("sgd", global_batch=64, micro=16, k=4,
                 adaptive={"batch_size": "goodput", "min_batch_size": 16, "interval_steps": 3})
    run = prepare(Regression(), s, total_steps=40, world=ONE)
    ctl = run.adaptive
    assert ctl.tuner.max_micro_batch_size == 16 and ctl.tuner.max_batch_size == 64 * 32
    ctl.measure_step_time = False
    run.step_hooks.insert(0, lambda r: ctl.tuner.record(
        r.plan.micro_batch_size, r.k_steps, 1, step_time(model_t, r.plan.micro_batch_size,
                                                         r.k_steps, 1)))
    x, y = regression_data(6, 64)
    with caplog.at_level(logging.INFO, logger="bigbatch.adaptive"):
        feed(run, x, y, 16, loss=F.mse_loss)
    assert len(run.batch_size_changes) == 1
    change = run.batch_size_changes[0]
    assert (change["step"], change["old"], change["new"], change["k_steps"]) == (3, 64, 16, 1)
    assert change["reason"].startswith("change batch 64") and change["reason"] in caplog.text
    assert run.plan.global_batch_size == 16 and run.k_steps == run.plan.k_steps == 1
    assert run.plan.peak_lr == pytest.approx(0.05 * math.sqrt(16 / 64))  # the sqrt rule
    assert run.schedule.peak_lr == run.plan.peak_lr
    assert run.progress_rate == 0.25 and run.progress == pytest.approx(3 + 3 * 0.25)
    assert run.stats["global_batch_size"] == 16
    # the plan and the decisions come back on resume
    other = prepare(Regression(), s, total_steps=40, world=ONE)
    other.load_state_dict(_roundtrip(run.state_dict()))
    assert other.plan == run.plan and other.k_steps == 1 and other.schedule == run.schedule
    assert other.batch_size_changes == run.batch_size_changes and other.lr_at(5) == run.lr_at(5)


def test_goodput_records_measured_step_times():
    s = strategy("sgd", global_batch=64, micro=32, k=2, adaptive={"batch_size": "goodput"})
    run = prepare(Regression(), s, total_steps=40, world=ONE)
    x, y = regression_data(4, 64)
    feed(run, x, y, 32, loss=F.mse_loss)
    (m, k, w, seconds, count), = run.adaptive.tuner.samples
    assert (m, k, w, count) == (32, 2, 1, 3) and seconds > 0  # the first step is warm-up
    assert 0 < run.last_step_seconds < 10


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("adaptive", [{"noise_scale": True}, {"batch_size": "goodput"}])
def test_adasum_with_noise_scale_is_a_config_error(adaptive):
    s = strategy("sgd", data_parallel={"reduce": "adasum"}, adaptive=adaptive)
    with pytest.raises(ConfigError, match="adasum") as e:
        prepare(make_model(), s, total_steps=3, world=ONE)
    assert "\n" not in str(e.value) and "adaptive." in str(e.value)


def test_goodput_bad_limits_are_config_errors():
    s = strategy("sgd", global_batch=256, adaptive={"batch_size": "goodput", "max_batch_size": 64})
    with pytest.raises(ConfigError, match="min_batch_size=64|max_batch_size"):
        prepare(make_model(), s.with_overrides(["adaptive.min_batch_size=128"]), total_steps=3,
                world=ONE)


def test_adam_sq_norm_is_exact_in_float64():
    # gns.adam_sq_norm once rounded float64 gradients and Adam's bias correction to float32.
    from bigbatch.adaptive.gns import adam_sq_norm

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_data(steps=2)
    for t in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x[t]), y[t]).backward()
        opt.step()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    moments = [(opt.state[p]["exp_avg_sq"], float(opt.state[p]["step"])) for p in params]
    expected = sq(precondition(grads, moments))
    assert float(adam_sq_norm(opt, params, grads)) == pytest.approx(expected, rel=1e-13)


# ---------------------------------------------------------------- bigbatch gns


class TinyTask:
    """A `Task`-shaped classification problem small enough for a unit test."""

    name, models, default_model = "tiny", ("net",), "net"

    def __init__(self) -> None:
        from torch.utils.data import TensorDataset

        x = make_data(steps=1, n=512)[0][0]
        y = (x @ torch.linspace(-1, 1, 32, dtype=x.dtype).reshape(8, 4)).argmax(-1)  # learnable
        self.train_set = TensorDataset(x, y)

    def check_model(self, name):
        return name or "net"

    def build_model(self, name=None):
        return make_model()

    def recipe(self, model=None):
        from bigbatch.tasks import Recipe

        return Recipe(base_batch_size=64, base_lr=0.1, epochs=1)

    def loss(self, output, batch):
        return F.cross_entropy(output, batch[1], reduction="sum"), batch[1].numel()


def test_window_estimate_by_hand():
    from bigbatch.study.noise_scale import window_estimate

    exact = window_estimate([{"sq_norm": g, "trace": 10 * g} for g in (1.0, 2.0, 3.0)])
    assert exact["b_simple"] == 10.0 and exact["stderr"] == 0.0 and exact["estimates"] == 3
    # S = [12, 18, 30], G = [1, 2, 3]: B = 60/6 = 10, residuals 2, -2, 0
    est = window_estimate([{"sq_norm": g, "trace": s} for g, s in ((1, 12), (2, 18), (3, 30))])
    assert est["b_simple"] == 10.0
    assert est["stderr"] == pytest.approx(math.sqrt(8 / 36 * 3 / 2))
    assert math.isinf(window_estimate([{"sq_norm": -1.0, "trace": 5.0}] * 3)["b_simple"])


def test_measure_noise_scale_points_and_summary():
    from bigbatch.study.noise_scale import critical_batch, format_report, measure_noise_scale

    points = measure_noise_scale(TinyTask(), steps=24, points=3, steps_per_point=4, world=ONE)
    assert [p["step"] for p in points] == [4, 14, 24]
    assert all(p["estimates"] == 4 and not p["biased"] for p in points)  # merge: unbiased
    assert all(p["global_batch_size"] == 64 and p["b_simple"] > 0 for p in points)
    summary = critical_batch(points)
    assert summary["b_simple"] == points[-1]["b_simple"] and summary["step"] == 24
    assert summary["low"] <= summary["b_simple"] <= summary["high"]
    report = format_report(points, summary)
    assert "critical batch (B_simple at step 24)" in report and len(report.splitlines()) == 6


def test_gns_command_on_mnist1d(tmp_path, capsys):
    import json

    from bigbatch.cli.gns import main

    out = tmp_path / "gns.json"
    rc = main(["--task-opt", "num_samples=600", "--task-opt", f"cache_dir='{tmp_path}'",
               "--steps", "8", "--points", "2", "--steps-per-point", "3", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "mnist1d (cnn), 1 worker(s)" in text and "critical batch" in text
    got = json.loads(out.read_text())
    assert [p["step"] for p in got["points"]] == [3, 8] and "critical_batch" in got
    assert main(["--points", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bigbatch gns: error: argument --points: must be >= 1, got 0")
