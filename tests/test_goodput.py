"""Goodput: throughput model, fitting, efficiency, the optimum and the hysteresis."""

import io
import itertools
import math

import numpy as np
import pytest
import torch

from bigbatch.adaptive.adascale import AdaScale
from bigbatch.adaptive.goodput import (
    GoodputTuner,
    ThroughputParams,
    efficiency,
    fit_throughput,
    goodput,
    step_time,
)
from bigbatch.errors import ConfigError

TRUE = ThroughputParams(alpha_c=0.02, beta_c=0.004, alpha_n=0.05, beta_n=0.01, gamma=2.5)


def _through_torch_save(state):
    """Checkpoints go through torch.save / torch.load(weights_only=True): plain types only."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_step_time_by_hand():
    p = ThroughputParams(alpha_c=1.0, beta_c=0.5, alpha_n=2.0, beta_n=1.0, gamma=1.0)
    assert step_time(p, 4, 1, 1) == pytest.approx(3.0)  # no sync on one worker
    assert step_time(p, 4, 3, 1) == pytest.approx(9.0)
    # Pollux: T_sync = alpha_n + beta_n (n - 2) from two workers on: alpha_n alone at n = 2.
    assert step_time(p, 4, 1, 2) == pytest.approx(3.0 + 2.0)  # gamma 1: times add
    assert step_time(p, 4, 1, 3) == pytest.approx(3.0 + 3.0)
    assert step_time(p, 4, 2, 4) == pytest.approx(3.0 + 3.0 + 4.0)
    p2 = ThroughputParams(1.0, 0.5, 2.0, 1.0, gamma=2.0)
    assert step_time(p2, 4, 2, 4) == pytest.approx(3.0 + 5.0)  # sqrt(3^2 + 4^2)
    p_big = ThroughputParams(1.0, 0.5, 2.0, 1.0, gamma=200.0)
    assert step_time(p_big, 4, 1, 4) == pytest.approx(4.0, rel=0.01)  # near the max
    out = step_time(p, np.array([4, 8]), np.array([1, 1]), np.array([1, 1]))
    np.testing.assert_allclose(out, [3.0, 5.0])


def test_efficiency_and_adascale_agree():
    assert efficiency(256, 1000.0, 256) == 1.0
    assert efficiency(1256, 1000.0, 256) == pytest.approx(1256 / 2256)
    assert efficiency(4096, math.inf, 256) == 1.0
    assert efficiency(512, -5.0, 256) == pytest.approx(0.5)  # no noise: B0 / B
    for b in (256, 1024, 8192):
        r = AdaScale(256, b).gain(sq_norm=0.01, trace=10.0)
        assert efficiency(b, 1000.0, 256) == pytest.approx(r / (b / 256))


def _grid_samples(params, ms=(4, 8, 16, 32, 64), ks=(1, 2, 4), ns=(1, 2, 4, 8)):
    return [(m, k, n, step_time(params, m, k, n)) for m, k, n in itertools.product(ms, ks, ns)]


@pytest.mark.parametrize(
    "true",
    [
        TRUE,
        ThroughputParams(0.1, 0.001, 0.3, 0.002, gamma=1.0),
        ThroughputParams(0.005, 0.02, 0.2, 0.05, gamma=7.0),
    ],
)
def test_fit_recovers_parameters_from_noiseless_samples(true):
    fitted = fit_throughput(_grid_samples(true))
    for name in ("alpha_c", "beta_c", "alpha_n", "beta_n", "gamma"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=2e-3), name


def test_fit_with_unidentifiable_parts():
    one_worker = fit_throughput(_grid_samples(TRUE, ns=(1,)))
    assert (one_worker.alpha_n, one_worker.beta_n, one_worker.gamma) == (0.0, 0.0, 1.0)
    assert one_worker.alpha_c == pytest.approx(TRUE.alpha_c, rel=1e-3)
    one_micro = fit_throughput(_grid_samples(TRUE, ms=(16,), ns=(1,)))
    # One micro size: half fixed, half per example, and exact at that size.
    assert one_micro.alpha_c == pytest.approx(one_micro.beta_c * 16)
    assert step_time(one_micro, 16, 3, 1) == pytest.approx(step_time(TRUE, 16, 3, 1), rel=1e-6)
    two_workers = fit_throughput(_grid_samples(TRUE, ns=(1, 2)))
    assert two_workers.beta_n == 0.0
    for m in (4, 64):
        assert step_time(two_workers, m, 2, 2) == pytest.approx(step_time(TRUE, m, 2, 2), rel=1e-3)


def test_fit_tolerates_noise():
    rng = np.random.default_rng(0)
    noisy = [(m, k, n, t * math.exp(rng.normal(0, 0.02))) for m, k, n, t in _grid_samples(TRUE)]
    fitted = fit_throughput(noisy)
    for m, k, n in [(8, 1, 1), (64, 4, 8), (32, 1, 4)]:
        assert step_time(fitted, m, k, n) == pytest.approx(step_time(TRUE, m, k, n), rel=0.03)


def test_fit_rejects_bad_samples():
    with pytest.raises(ConfigError, match="no step-time samples"):
        fit_throughput([])
    with pytest.raises(ConfigError, match="seconds > 0"):
        fit_throughput([(8, 1, 1, 0.0)])


def _tuner_with_model(params, world, **kwargs) -> GoodputTuner:
    tuner = GoodputTuner(**kwargs)
    for m, k, n, t in _grid_samples(params, ns=sorted({1, world})):
        tuner.record(m, k, n, t)
    return tuner


def test_picks_analytic_optimum():
    # One worker, k = 1, gamma irrelevant: goodput ~ m / ((a + b m)(phi + m)) peaks at
    # m* = sqrt(a phi / b) (set the derivative of its log to zero).
    p = ThroughputParams(alpha_c=0.1, beta_c=0.001)
    phi = 1000.0
    tuner = _tuner_with_model(
        p, 1, base_batch_size=32, min_batch_size=1, max_batch_size=1024, max_micro_batch_size=1024
    )
    s = tuner.suggest(32, 1, 1, noise_scale=phi)
    assert s.changed and s.k_steps == 1 and s.world_size == 1
    assert abs(s.global_batch_size - math.sqrt(0.1 * phi / 0.001)) <= 1.0
    assert s.reason.startswith("change batch 32 (micro 32 x 1 merge x 1 workers) -> ")
    assert "noise scale 1000" in s.reason and "%" in s.reason


def test_picks_brute_force_optimum_with_merge_and_workers():
    world, max_micro, phi, base = 4, 24, 3000.0, 64
    tuner = _tuner_with_model(
        TRUE,
        world,
        base_batch_size=base,
        min_batch_size=64,
        max_batch_size=4096,
        max_micro_batch_size=max_micro,
        threshold=0.0,
    )
    best, best_good = None, -1.0
    for m in range(1, max_micro + 1):
        for k in range(1, 4096 // (m * world) + 1):
            b = m * k * world
            if b < 64:
                continue
            t = (k - 1) * (TRUE.alpha_c + TRUE.beta_c * m) + (
                (TRUE.alpha_c + TRUE.beta_c * m) ** TRUE.gamma
                + (TRUE.alpha_n + TRUE.beta_n * (world - 2)) ** TRUE.gamma
            ) ** (1 / TRUE.gamma)
            g = b / t * (phi + base) / (phi + b)
            if g > best_good:
                best, best_good = (m, k), g
    s = tuner.suggest(8, 2, world, noise_scale=phi)
    assert s.changed and (s.micro_batch_size, s.k_steps) == best
    assert s.k_steps > 1  # the memory limit forces merge steps
    assert s.goodput == pytest.approx(best_good, rel=1e-3)
    assert s.goodput == pytest.approx(goodput(TRUE, *best, world, phi, base), rel=1e-3)


def test_larger_noise_scale_means_larger_batch():
    kwargs = dict(base_batch_size=32, min_batch_size=32, max_batch_size=8192)
    tuner = _tuner_with_model(TRUE, 2, max_micro_batch_size=256, threshold=0.0, **kwargs)
    batches = [
        tuner.suggest(32, 1, 2, noise_scale=phi).global_batch_size for phi in (1e2, 1e3, 1e4)
    ]
    assert batches == sorted(batches) and batches[0] < batches[-1]
    s = tuner.suggest(32, 1, 2, noise_scale=math.inf)  # efficiency 1: max throughput
    assert s.global_batch_size == 8192 and s.micro_batch_size == 256


def test_threshold_hysteresis():
    p = ThroughputParams(alpha_c=0.1, beta_c=0.001)
    kwargs = dict(base_batch_size=32, min_batch_size=1, max_batch_size=1024)
    tuner = _tuner_with_model(p, 1, max_micro_batch_size=1024, threshold=0.05, **kwargs)
    best = tuner.suggest(32, 1, 1, noise_scale=1000.0)
    assert best.changed
    # The optimum stays put.
    again = tuner.suggest(best.micro_batch_size, 1, 1, noise_scale=1000.0)
    assert not again.changed and "already the best" in again.reason
    # Near the optimum (within 5%): keep, and say why.
    near = 200
    ratio = best.goodput / goodput(p, near, 1, 1, 1000.0, 32)
    assert 1.0 < ratio < 1.05
    kept = tuner.suggest(near, 1, 1, noise_scale=1000.0)
    assert not kept.changed and kept.global_batch_size == near
    assert "within threshold 5.0%" in kept.reason
    # Far from it: move.
    assert tuner.suggest(50, 1, 1, noise_scale=1000.0).changed
    # With no threshold even the small gain moves.
    tuner.threshold = 0.0
    assert tuner.suggest(near, 1, 1, noise_scale=1000.0).changed


def test_keeps_without_information():
    kwargs = dict(base_batch_size=32, min_batch_size=32, max_batch_size=1024)
    tuner = GoodputTuner(max_micro_batch_size=64, **kwargs)
    s = tuner.suggest(32, 1, 1, noise_scale=100.0)
    assert not s.changed and "no step times" in s.reason and s.global_batch_size == 32
    tuner.record(32, 1, 1, 0.5)
    s = tuner.suggest(32, 1, 1, noise_scale=math.nan)
    assert not s.changed and "noise scale" in s.reason


def test_moves_into_range_regardless_of_threshold():
    kwargs = dict(base_batch_size=32, min_batch_size=128, max_batch_size=512)
    tuner = _tuner_with_model(TRUE, 1, max_micro_batch_size=64, threshold=10.0, **kwargs)
    s = tuner.suggest(32, 1, 1, noise_scale=50.0)
    assert s.changed and 128 <= s.global_batch_size <= 512
    assert "outside [128, 512]" in s.reason


def test_micro_batch_sizes_restrict_the_search():
    kwargs = dict(base_batch_size=32, min_batch_size=32, max_batch_size=4096)
    tuner = _tuner_with_model(
        TRUE, 1, max_micro_batch_size=256, micro_batch_sizes=[32, 64, 128], **kwargs
    )
    ms, ks = tuner.candidates(1)
    assert set(ms.tolist()) == {32, 64, 128}
    assert ((ms * ks >= 32) & (ms * ks <= 4096)).all()
    s = tuner.suggest(32, 1, 1, noise_scale=1e5)
    assert s.micro_batch_size in (32, 64, 128)


def test_state_dict_round_trip():
    kwargs = dict(base_batch_size=32, min_batch_size=32, max_batch_size=2048)
    a = _tuner_with_model(TRUE, 2, max_micro_batch_size=128, **kwargs)
    a.record(8, 1, 1, 0.1)
    a.fit()
    b = GoodputTuner(max_micro_batch_size=128, **kwargs)
    b.load_state_dict(_through_torch_save(a.state_dict()))
    assert b.samples == a.samples and b.params == a.params
    assert b.state_dict() == a.state_dict()
    assert b.suggest(16, 1, 2, 500.0) == a.suggest(16, 1, 2, 500.0)


def test_record_averages_repeated_configurations():
    tuner = GoodputTuner(32, min_batch_size=1, max_batch_size=64, max_micro_batch_size=64)
    tuner.record(8, 1, 1, 1.0)
    tuner.record(8, 1, 1, 3.0)
    tuner.record(8, 1, 1, math.nan)  # ignored
    assert tuner.samples == [(8, 1, 1, 2.0, 2)]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(min_batch_size=64, max_batch_size=32), "min_batch_size"),
        (dict(min_batch_size=0, max_batch_size=32), "min_batch_size"),
        (dict(min_batch_size=1, max_batch_size=32, threshold=-1.0), "gain_threshold"),
        (dict(min_batch_size=1, max_batch_size=32, micro_batch_sizes=[128]), "micro_batch_sizes"),
    ],
)
def test_rejects_bad_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GoodputTuner(32, max_micro_batch_size=64, **kwargs)
